-- migrate: no-transaction
-- 0018: one mailbox key, computed once (docs/model.md, "The mailbox key").
--   * mail.suppression.email_key: the mailbox key of an address suppression (mailflow.store.policy.
--     mailbox_key: trim, NFC, IDNA domain, Unicode case folding), written with the row; lookups
--     compare it with the stored send_log.email_key. Until now both sides went through PostgreSQL's
--     lower(), which depends on the database's LC_CTYPE: under C it leaves every non-ASCII capital
--     (Ä) as it is, under C.UTF-8 it disagrees with Python on final sigma and İ, so a bounced
--     address with a non-ASCII local part was mailed again.
--   * mail.mailbox: the contact guard's lock rows for mailboxes (one per key ever claimed for), taken
--     after the users' mail.contact rows, each set in key order, in the claim transaction: two user
--     ids at one mailbox serialise like two claims of one user.
--   * the keys are backfilled in Python (PostgreSQL cannot compute them: case folding and IDNA) by
--     the step `backfill_mailbox_keys` (mailflow.store.backfill), resumable and idempotent: the
--     suppressions' keys, send-log rows without a key or with a non-ASCII address (the old key was a
--     lower(); ASCII keys are unchanged), and mail.campaign_address's non-ASCII keys.
--   * `require_suppression_keys` adds CHECK (email is null or email_key is not null) NOT VALID: a new
--     address suppression without its key (a bare INSERT, which nothing would match) fails loudly.
--   * then the unique index on (email_key, scope) replaces 0001's (lower(email), scope), and the
--     guard's mailbox probe gets its covering index on send_log (email_key, sent_at), built
--     CONCURRENTLY (no lock that blocks reads or writes; an interrupted build is rebuilt).
-- Every statement is idempotent: an interrupted run is resumed from the start by the next one.
alter table mail.suppression add column if not exists email_key text;
comment on column mail.suppression.email_key is
    'Mailbox key of the suppressed address (mailflow.store.policy.mailbox_key; computed in Python when '
    'the row is written, never by SQL); null for a suppression by user only.';
create table if not exists mail.mailbox (
    email_key  text        primary key,
    created_at timestamptz not null default now()
);
comment on table mail.mailbox is
    'The contact guard for mailboxes: one row per mailbox key ever claimed for. Every claim of a new '
    'email locks its users'' mail.contact rows, then its mailboxes'' rows (each in key order), so two '
    'user ids at one mailbox serialise and the contact policy counts the mailbox''s emails too.';
comment on column mail.mailbox.email_key is 'Mailbox key (mail.send_log.email_key).';
comment on column mail.mailbox.created_at is 'First claim for this mailbox (timestamptz, UTC).';
-- migrate: python backfill_mailbox_keys
-- migrate: python require_suppression_keys
create unique index concurrently if not exists suppression_email_key_scope_uq
    on mail.suppression (email_key, scope) where email_key is not null;
drop index concurrently if exists mail.suppression_email_scope_uq;
create index concurrently if not exists send_log_mailbox_idx on mail.send_log (email_key, sent_at)
    include (status, scheduled_at, minted_at, user_id, campaign) where status in ('pending', 'sending', 'sent');
