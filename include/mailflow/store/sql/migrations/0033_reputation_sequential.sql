-- 0033: the reputation guard judges outcomes sequentially and bounds what a scope may send before its
-- rates are known (docs/operations.md, "Reputation guard").
--
-- The rates were read from the newest sends, which at full speed are exactly the emails with no outcome
-- yet: a bad audience could be mailed whole while every evaluation read a sample of 0. Now each scope
-- (a campaign, the provider account) keeps running statistics fed by the outcome counters
-- (mail.campaign_counts, 0028): each evaluation adds what arrived since the last one, so every outcome is
-- counted once, whenever it arrives and however old its email is.
--
-- * llr_bounce, llr_gross, llr_complaint: the log-likelihood ratios of three one-sided sequential tests
--   (hard bounces; complaints against a gross rate; complaints against the complaint line, with delivered
--   emails weighed by how much of the complaint lag they have lived). Each is floored at the test's lower
--   boundary (a CUSUM: old good news never hides new bad news) and trips the scope at the upper one.
-- * proven: the bounce and gross-complaint tests have reached their lower boundary (the rates are known to
--   be healthy with the confidence the rule needs) and not risen above 0 since. While a scope is not proven
--   at most `exposure` of its emails are sent per round (round_sent); a new round starts when as many
--   outcomes arrived as the round sent, or when none came for the outcome wait. waiting: the round is spent.
-- * seen: the counters at the last evaluation; delivered_marks and evidence: the lag-weighted delivered
--   count (the complaint test's denominator). cum_*: totals since the scope's baseline (its first
--   evaluation or a person's resume), shown as the rates and the sample.
--
-- Only brief locks: columns with constant defaults on a small table. Existing scopes start unproven, except
-- an ok scope whose last window already held 1,500 outcomes under the new default lines (2 % hard bounces,
-- 0.04 % complaints): it was judged on at least the evidence the new tests need to prove one (about 300
-- clean outcomes for the bounce test, 1,280 clean deliveries for the gross-complaint test; the margin
-- covers the window's bounces).

alter table mail.reputation_guard
    add column if not exists llr_bounce       double precision not null default 0,
    add column if not exists llr_gross        double precision not null default 0,
    add column if not exists llr_complaint    double precision not null default 0,
    add column if not exists proven           boolean          not null default false,
    add column if not exists seen             jsonb,
    add column if not exists delivered_marks  jsonb            not null default '[]'::jsonb,
    add column if not exists evidence         double precision not null default 0,
    add column if not exists cum_outcomes     bigint           not null default 0,
    add column if not exists cum_hard         bigint           not null default 0,
    add column if not exists cum_complaints   bigint           not null default 0,
    add column if not exists cum_delivered    bigint           not null default 0,
    add column if not exists awaiting         bigint,
    add column if not exists round_sent       integer          not null default 0 check (round_sent >= 0),
    add column if not exists round_outcomes   bigint,
    add column if not exists round_started_at timestamptz,
    add column if not exists last_grant_at    timestamptz,
    add column if not exists waiting          boolean          not null default false;

update mail.reputation_guard
set proven = true
where state = 'ok' and not proven and sample >= 1500 and hard_bounce_rate < 0.02 and complaint_rate < 0.0004;

-- The per-account lines: a row overrides the defaults of mailflow.store.reputation (per provider) for
-- one account; a null column keeps the default.
create table if not exists mail.reputation_setting (
    account          text             primary key,
    hard_bounce_rate double precision check (hard_bounce_rate > 0 and hard_bounce_rate < 1),
    complaint_rate   double precision check (complaint_rate > 0 and complaint_rate < 1),
    exposure         integer          check (exposure >= 100),
    complaint_lag_hours double precision check (complaint_lag_hours > 0),
    updated_at       timestamptz      not null default now(),
    updated_by       text             not null
);

comment on table mail.reputation_setting is
    'Reputation guard settings of one provider account (the account scope''s name); null: the default.';
comment on column mail.reputation_setting.hard_bounce_rate is 'The hard-bounce line the guard must stay under (fraction).';
comment on column mail.reputation_setting.complaint_rate is 'The complaint line the guard must stay under (fraction).';
comment on column mail.reputation_setting.exposure is 'E: emails a scope may send per round before its rates are known.';
comment on column mail.reputation_setting.complaint_lag_hours is 'Over how many hours after delivery complaints are expected.';
comment on column mail.reputation_guard.llr_bounce is 'Hard-bounce test: log-likelihood ratio (line vs a quarter of it), floored at the lower boundary.';
comment on column mail.reputation_guard.llr_gross is 'Gross-complaint test: log-likelihood ratio (10x the complaint line vs the line).';
comment on column mail.reputation_guard.llr_complaint is 'Complaint test: log-likelihood ratio (line vs a quarter of it), delivered emails weighed by the complaint lag.';
comment on column mail.reputation_guard.proven is 'The bounce and gross-complaint rates are known to be healthy: no exposure bound.';
comment on column mail.reputation_guard.round_sent is 'Emails granted in the current round while not proven (at most the exposure E).';
comment on column mail.reputation_guard.waiting is 'The round is spent: nothing more is sent until its outcomes arrive or the outcome wait passes.';
comment on column mail.reputation_guard.awaiting is 'Sent emails without a final outcome at the last evaluation.';
comment on column mail.reputation_guard.sample is 'Emails with an outcome since the scope''s baseline (first evaluation or resume).';
comment on column mail.reputation_guard.hard_bounce_rate is 'Hard bounces / emails with an outcome since the baseline (fraction 0..1).';
comment on column mail.reputation_guard.complaint_rate is 'Complaints / delivered emails since the baseline (fraction 0..1).';
comment on column mail.reputation_guard.seen is 'The outcome counters (mail.campaign_counts) at the last evaluation: what the next one adds is the gain since.';
comment on column mail.reputation_guard.delivered_marks is 'Marks [epoch seconds, delivered since the baseline] for the complaint lag: the lag-average of the delivered count.';
comment on column mail.reputation_guard.evidence is 'The complaint test''s trials at the last evaluation: delivered emails weighed by the part of the complaint lag they lived.';
comment on column mail.reputation_guard.cum_outcomes is 'Emails with a final outcome since the baseline.';
comment on column mail.reputation_guard.cum_hard is 'Hard bounces since the baseline.';
comment on column mail.reputation_guard.cum_complaints is 'Complaints since the baseline.';
comment on column mail.reputation_guard.cum_delivered is 'Delivered emails since the baseline.';
comment on column mail.reputation_guard.round_outcomes is 'The outcome count when the current exposure round started (it ends when as many more arrived as it sent).';
comment on column mail.reputation_guard.round_started_at is 'When the current exposure round started (null: none running).';
comment on column mail.reputation_guard.last_grant_at is 'The last grant of the exposure bound (a round without outcomes ends an outcome wait after it).';
comment on column mail.reputation_setting.account is 'The provider account (the account scope''s name).';
comment on column mail.reputation_setting.updated_at is 'When the settings were last changed.';
comment on column mail.reputation_setting.updated_by is 'Who changed them (mailflow reputation set --by).';
