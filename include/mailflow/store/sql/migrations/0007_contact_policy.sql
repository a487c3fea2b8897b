-- 0007: one contact policy for every path (docs/model.md, "The contact policy").
--   * mail.contact: one row per user ever claimed for; every path that claims a NEW email (lifecycle
--     mint, scheduled claim; manual and backfill runs are lifecycle mints) locks its users' rows
--     FOR UPDATE, in user_id order, in the claim transaction, and re-checks the policy after the
--     lock: concurrent claimers of one user serialise, so at most one claim within the policy wins.
--   * mail.campaign_address: one email per (campaign, normalised address): the first user to claim
--     an address for a campaign holds it; another user at that address gets a 'duplicate' row.
--   * send_log.email_key: the normalised address (lower-cased local part @ IDNA lower-cased domain).
--   * two terminal states: 'skipped' (held back by the policy, the campaign chose skip) and
--     'duplicate' (another user of the campaign got the email at this address); the reason is in
--     `error`, and an event is appended as for every change.
--   * mail.campaign.on_policy: what a scheduled campaign does with a due email the policy holds back.
-- Only brief locks (new tables, a metadata-only column, a NOT VALID check): safe on a live send log.
-- Every timestamp is timestamptz (stored in UTC).

create table mail.contact (
    user_id    bigint      primary key,
    created_at timestamptz not null default now()
);
comment on table mail.contact is
    'The contact guard: one row per user ever claimed for. Every claim of a new email (lifecycle mint, '
    'scheduled claim) locks its users'' rows FOR UPDATE in user_id order and re-checks the contact '
    'policy under the lock, so concurrent claimers of one user serialise. The emails themselves are in '
    'mail.send_log.';
comment on column mail.contact.user_id is 'Recipient''s app user id.';
comment on column mail.contact.created_at is 'First claim for this user (timestamptz, UTC).';

alter table mail.send_log add column email_key text;
comment on column mail.send_log.email_key is
    'Normalised address for deduplication: local part lower-cased @ IDNA (punycode) domain lower-cased; '
    'null for rows written before migration 0007.';
create table mail.campaign_address (
    campaign   text        not null,
    email_key  text        not null,
    user_id    bigint      not null,
    created_at timestamptz not null default now(),
    primary key (campaign, email_key)
);
comment on table mail.campaign_address is
    'One email per campaign and normalised address: the user who first claimed the address for the '
    'campaign (lifecycle mint or scheduled claim, in the claim transaction). Another user at the same '
    'address gets a send_log row with status duplicate naming this user.';
comment on column mail.campaign_address.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.campaign_address.email_key is 'Normalised address (see mail.send_log.email_key).';
comment on column mail.campaign_address.user_id is 'The user who holds the address for this campaign.';
comment on column mail.campaign_address.created_at is 'When it was claimed (timestamptz, UTC).';

-- Widen the status check with the two new terminal states, keeping whatever states the constraint
-- already allows (another migration may have added some).
do $$
declare
    allowed text[];
begin
    select coalesce(array_agg(distinct m[1]), '{}')
      into allowed
      from pg_constraint k,
           regexp_matches(pg_get_constraintdef(k.oid), '''([a-z_]+)''', 'g') as m
     where k.conrelid = 'mail.send_log'::regclass and k.conname = 'send_log_status_check';
    allowed := array(select distinct s from unnest(allowed || array['pending', 'sending', 'sent', 'failed',
                                                                     'cancelled', 'skipped', 'duplicate']) as s
                     order by s);
    execute 'alter table mail.send_log drop constraint if exists send_log_status_check';
    -- NOT VALID: no scan under an exclusive lock; every existing row passed the narrower check
    execute format('alter table mail.send_log add constraint send_log_status_check '
                   'check (status = any (%L::text[])) not valid', allowed);
end
$$;

alter table mail.campaign add column on_policy text not null default 'defer'
    check (on_policy in ('defer', 'skip', 'ignore'));
comment on column mail.campaign.on_policy is
    'A due email the contact policy holds back: defer (default: to the first planned slot after the '
    'window, within the campaign''s windows, weekdays and daily count), skip (status skipped with the '
    'reason) or ignore (the campaign is exempt: sent regardless, e.g. transactional; still a contact).';
comment on column mail.send_log.status is
    'pending (planned), sending (claimed, in flight), sent, failed (rejected, invalid address, rolled back '
    'or given up), cancelled, skipped (held back by the contact policy) or duplicate (another user got '
    'this campaign at the same normalised address; error names them).';
