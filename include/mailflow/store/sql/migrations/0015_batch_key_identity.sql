-- 0015: a batch remembers which API key it was first sent with.
-- The provider scopes idempotency keys per API key (Resend does not document the scope; the
-- emulator scopes them per key, as harsh as it could be), so an ambiguous batch resent under another
-- key would be processed a second time. The store writes send_batch.key_identity (a non-secret
-- identity of the key: "key#<16 hex of sha256>", never the key; not the base URL: a key
-- belongs to one account whatever URL reaches it) in the statement that stores
-- the bytes; the reconciler resends a batch only under the same identity and holds it otherwise
-- (docs/operations.md, "Rotating the API key").
-- Existing batches keep NULL (unknown: sent before this migration): the reconciler treats them as
-- sent under the connection's current key, which is what every resend did before, so an existing
-- installation keeps recovering them. ADD COLUMN without a default: a catalog change, no rewrite.
-- mail.api_key_identity is what the reconciler last found configured (current and previous keys),
-- so `mailflow keys` can say which identities are still usable without reading any secret.
alter table mail.send_batch add column if not exists key_identity text;

create table if not exists mail.api_key_identity (
    identity text        primary key,
    role     text        not null check (role in ('current', 'previous')),
    seen_at  timestamptz not null default now()
);

comment on column mail.send_batch.key_identity is
    'Non-secret identity of the API key the batch was first sent with ("key#<16 hex of '
    'sha256(''mailflow-key-id:'' || key)>"); a resend uses the same key (idempotency keys are scoped per API '
    'key). Null: stored before 0015 or by a sender without an identity; resent under the current key.';
comment on table mail.api_key_identity is
    'The API key identities the reconciler found configured at its latest run (the resend connection''s '
    'key and its previous_api_keys), read by `mailflow keys`. Replaced as a whole by each reconcile run.';
comment on column mail.api_key_identity.identity is 'Key identity, as in mail.send_batch.key_identity (no secret).';
comment on column mail.api_key_identity.role is 'current: the connection''s key; previous: a key kept for resends only.';
comment on column mail.api_key_identity.seen_at is 'When a reconcile run last recorded it (database clock).';

-- the read-only role (0004) reads the new column (send_batch is granted column by column)
do $$
begin
    if exists (select 1 from pg_roles where rolname = 'mail_analyst') then
        execute 'grant select (key_identity) on mail.send_batch to mail_analyst';
        execute 'grant select on mail.api_key_identity to mail_analyst';
    end if;
exception
    when insufficient_privilege then
        raise warning 'mailflow 0015: cannot grant to mail_analyst: %', sqlerrm;
end
$$;
