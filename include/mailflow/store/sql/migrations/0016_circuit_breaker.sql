-- 0016: a circuit breaker shared by every sender, and a person's decision on a dead letter.
--
-- mail.circuit_breaker holds one row per provider account (like mail.rate_slot). A whole-request
-- failure (a 5xx after retries, a timeout, a reset, a refused connection) opens it; while it is
-- open no path mints or claims new rows. One probe at a time (a lease: probe_holder until
-- probe_until) tests the provider; an answer closes it (docs/operations.md "Circuit breaker").
--
-- mail.send_log gains the decision a person took on a dead letter (`mailflow dead-letters`):
-- 'resend' re-opens the rows (lifecycle: released, so the next run decides again; scheduled: back
-- to pending) under a new key, 'close' keeps them failed for good. Nothing is deleted: the decision
-- is stored on the row and appended as an event. Metadata-only columns (no default): no rewrite.
-- A lifecycle dead letter re-opened for a resend keeps its ambiguous_at as history and leaves the
-- unique key with released_at, so the check that forbids releasing an ambiguous row admits exactly
-- that case (NOT VALID: no scan under the lock; every existing row passed the narrower check).
create table if not exists mail.circuit_breaker (
    account       text        primary key,
    state         text        not null default 'closed' check (state in ('closed', 'open')),
    opened_at     timestamptz,
    reason        text,
    failures      bigint      not null default 0 check (failures >= 0),
    opened_total  bigint      not null default 0 check (opened_total >= 0),
    probe_holder  text,
    probe_until   timestamptz,
    probe_pid     integer,
    last_probe_at timestamptz,
    closed_at     timestamptz,
    closed_by     text,
    updated_at    timestamptz not null default now(),
    constraint circuit_breaker_open_has_reason check (state = 'closed' or (opened_at is not null and reason is not null))
);

comment on table mail.circuit_breaker is
    'One row per provider account: closed, or open since opened_at for reason (a whole-request failure). While '
    'open no sender mints or claims new rows; one probe at a time (probe_holder until probe_until) tests the '
    'provider, and an answer that proves it processes requests closes it.';
comment on column mail.circuit_breaker.account is
    'The provider account (the pacer''s account: the API base URL in production), as in mail.rate_slot.';
comment on column mail.circuit_breaker.state is
    'closed: senders mint and claim; open: nothing new is minted or claimed until a probe is answered.';
comment on column mail.circuit_breaker.opened_at is 'When the breaker last went from closed to open (database clock).';
comment on column mail.circuit_breaker.reason is 'The latest whole-request failure seen while open (the client''s reason).';
comment on column mail.circuit_breaker.probe_holder is 'Who holds the probe lease (a run and process id), or null.';
comment on column mail.circuit_breaker.last_probe_at is 'When a probe lease was last taken (database clock).';
comment on column mail.circuit_breaker.closed_at is 'When the breaker last closed (database clock).';
comment on column mail.circuit_breaker.closed_by is 'Who closed it: the probe''s holder, or "by hand: <name>" (mailflow breaker --close).';
comment on column mail.circuit_breaker.updated_at is 'The last change of this row (database clock).';
comment on column mail.circuit_breaker.failures is 'Whole-request failures seen since the breaker last opened.';
comment on column mail.circuit_breaker.opened_total is 'How many times the breaker opened (closed -> open).';
comment on column mail.circuit_breaker.probe_until is
    'The probe lease: only probe_holder may probe until then (database clock); an expired lease is free.';
comment on column mail.circuit_breaker.probe_pid is
    'The backend pid of the lease holder''s connection: a lease whose holder''s session is gone (the process '
    'died) is free at once, without waiting for probe_until.';

alter table mail.send_log
    add column if not exists dead_letter_decision   text check (dead_letter_decision in ('resend', 'close')),
    add column if not exists dead_letter_decided_at timestamptz,
    add column if not exists dead_letter_decided_by text;

comment on column mail.send_log.dead_letter_decision is
    'A person''s decision on this dead letter (mailflow dead-letters): resend (re-opened under a new key, '
    'accepting the risk of a duplicate) or close (failed for good). Null: nobody decided yet.';

comment on column mail.send_log.dead_letter_decided_at is 'When a person decided on this dead letter (database clock).';
comment on column mail.send_log.dead_letter_decided_by is 'Who decided on this dead letter (mailflow dead-letters --by).';

alter table mail.send_log drop constraint if exists send_log_ambiguous_never_released;
alter table mail.send_log add constraint send_log_ambiguous_never_released
    check (ambiguous_at is null or released_at is null or coalesce(dead_letter_decision = 'resend', false)) not valid;
