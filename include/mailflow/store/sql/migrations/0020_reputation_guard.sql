-- 0020: the reputation guard. Per campaign and per provider account, the rolling hard-bounce and complaint
-- rates over recent outcomes (mail.delivery_status), evaluated as outcomes arrive. Above a threshold, with at
-- least a minimum sample, the scope trips: a scheduled campaign is paused, a lifecycle campaign is skipped,
-- and an alert names the rates and the sample. Only a person resumes it (resumed_at, resumed_by); outcomes
-- before the resume no longer count. Every timestamp is timestamptz (stored in UTC).
create table if not exists mail.reputation_guard (
    scope            text        not null check (scope in ('campaign', 'account')),
    name             text        not null,
    state            text        not null default 'ok' check (state in ('ok', 'tripped')),
    hard_bounce_rate numeric     check (hard_bounce_rate between 0 and 1),
    complaint_rate   numeric     check (complaint_rate between 0 and 1),
    sample           integer     check (sample >= 0),
    evaluated_at     timestamptz,
    tripped_at       timestamptz,
    reason           text,
    resumed_at       timestamptz,
    resumed_by       text,
    resume_reason    text,
    alerted_at       timestamptz,
    primary key (scope, name),
    constraint reputation_guard_resumed_by_a_person check (resumed_at is null or resumed_by is not null),
    constraint reputation_guard_tripped_has_reason check (state = 'ok' or (tripped_at is not null and reason is not null))
);

comment on table mail.reputation_guard is
    'The reputation guard''s state per campaign and per provider account: ok, or tripped (sending stopped) since '
    'tripped_at because a rolling rate passed its threshold. A person resumes it.';
comment on column mail.reputation_guard.scope is 'campaign (name = mail.send_log.campaign) or account (name = the provider account).';
comment on column mail.reputation_guard.name is 'The campaign name, or the provider account (the pacer''s account key).';
comment on column mail.reputation_guard.state is 'ok: may send; tripped: a scheduled campaign is paused, a lifecycle campaign skipped.';
comment on column mail.reputation_guard.hard_bounce_rate is 'Hard bounces / emails with an outcome in the window, at the last evaluation (fraction 0..1).';
comment on column mail.reputation_guard.complaint_rate is 'Complaints / emails with an outcome in the window, at the last evaluation (fraction 0..1).';
comment on column mail.reputation_guard.sample is 'Emails with an outcome in the window at the last evaluation (the rates'' denominator).';
comment on column mail.reputation_guard.evaluated_at is 'Last evaluation (database clock).';
comment on column mail.reputation_guard.tripped_at is 'When it last tripped.';
comment on column mail.reputation_guard.reason is 'Why it tripped: the rate, its threshold and the sample.';
comment on column mail.reputation_guard.resumed_at is 'When a person last resumed it; outcomes of emails sent before this no longer count.';
comment on column mail.reputation_guard.resumed_by is 'Who resumed it (the CLI user or the DAG run''s user).';
comment on column mail.reputation_guard.resume_reason is 'Why the person resumed it (required by the CLI and the DAG).';
comment on column mail.reputation_guard.alerted_at is 'When the trip was put in an alert (null: not yet).';


-- Tripped scopes are few: the dispatcher's claim and the lifecycle source ask "is anything tripped for this
-- campaign or the account?" before every claim and chunk; this partial index answers it without reading the
-- ok rows (one per campaign ever evaluated).
create index if not exists reputation_guard_tripped_idx on mail.reputation_guard (scope, name) where state = 'tripped';
