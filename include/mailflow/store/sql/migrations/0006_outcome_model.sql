-- 0006: the outcome model (a request proven not processed is told apart from an ambiguous one).
-- * mail.installation: one random id per database, created here once. It is part of every
--   idempotency key, so two databases sharing one provider team (staging and production, a
--   restored backup, a `demo --reset`) never send one key with two bodies (Resend: 409
--   invalid_idempotent_request). See docs/model.md "Idempotency keys".
-- * mail.send_batch_serial: the batch's own identity inside one installation.
-- * send_batch.validation: the x-batch-validation mode the batch is sent with (every retry,
--   including the reconciler's, sends the same bytes under the same key with the same mode).
-- * send_log.ambiguous_at: set when a row is first part of a request whose outcome is unknown
--   (5xx, timeout, reset, a 2xx that does not add up, a resend of a stale batch). Such a row keeps
--   its key and bytes forever: it is never released, re-keyed or re-minted; only a 2xx answer to
--   its key resolves it, or it becomes a dead letter "unknown outcome" past the idempotency window.
create table mail.installation (
    singleton  boolean     primary key default true check (singleton),
    id         text        not null default replace(gen_random_uuid()::text, '-', ''),
    created_at timestamptz not null default now()
);
insert into mail.installation default values;

create sequence mail.send_batch_serial;

alter table mail.send_batch add column validation text
    check (validation is null or validation in ('strict', 'permissive'));
alter table mail.send_log add column ambiguous_at timestamptz;
-- An ambiguous row is never released (the guard lives in the release statement; this is the proof).
alter table mail.send_log add constraint send_log_ambiguous_never_released
    check (ambiguous_at is null or released_at is null);

comment on table mail.installation is
    'One row: this database''s installation id, part of every idempotency key (docs/model.md, '
    '"Idempotency keys"), so two databases sharing one provider team never send one key with two bodies.';
comment on column mail.installation.singleton is 'Always true: the table holds exactly one row.';
comment on column mail.installation.id is 'Random 32-hex installation id, created by migration 0006.';
comment on column mail.installation.created_at is 'When the installation id was created (timestamptz, UTC).';
comment on column mail.send_batch.validation is
    'x-batch-validation the batch is sent with (strict or permissive); null: the connection''s mode. '
    'Every retry, including the reconciler''s, uses the same mode with the same key and bytes.';
comment on column mail.send_log.ambiguous_at is
    'First time the row was part of a request whose outcome is unknown (5xx, timeout, reset, a 2xx that '
    'does not add up, a stale batch resent). Such a row keeps its key and bytes: it is never released or '
    're-keyed; only a 2xx to its key resolves it, or it is dead-lettered past the idempotency window.';
comment on column mail.send_log.dead_lettered_at is
    'When the email was given up for a person to decide (timestamptz, UTC): an unknown outcome past the '
    '24 h idempotency window (whole-request failures never dead-letter anyone since 0006). Null: not a dead letter.';
comment on column mail.send_log.attempts is
    'Requests of this row so far (the engine''s or dispatcher''s claim, reconciler resends add 1); a claim '
    'whose request was proven not processed is given back (scheduled rows).';
