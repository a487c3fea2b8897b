-- name: allocate
-- Ids for a chunk that is about to be minted, and its batch serial, BEFORE the rows exist:
-- the renderer needs each row's id (X-Mailflow-Send-Id) and the key needs the body, so with the ids
-- allocated first the rows are inserted once, already carrying their batch key and request index
-- (the old mint INSERTed, rendered, then UPDATEd every row with its key: a second, non-HOT version
-- of each row in every index). Sequence values are never reused: an id or serial whose
-- transaction rolls back is simply skipped.
select array(select nextval('mail.send_log_id_seq') from generate_series(1, %(n)s::int)) as ids,
       nextval('mail.send_batch_serial') as serial,
       (select id from mail.installation) as installation

-- name: taken
-- Users of the page who already hold a live row for this campaign (the (user, campaign) unique key),
-- read AFTER the contact guard's lock: every other lifecycle minter of these users waits for that
-- lock, so this set cannot grow before the mint commits (mint_keyed's ON CONFLICT stays the
-- backstop). Index-only on the live key, send_log_campaign_user_uq (0012).
select d.user_id from mail.send_log d
where d.user_id = any(%(ids)s::bigint[]) and d.campaign = %(campaign)s and d.released_at is null

-- name: mint_keyed
-- Mint one chunk as claimed ('sending') rows that already carry their batch key and request index
-- (ids from mint.allocate, key from the stored body: docs/model.md "Idempotency keys"), under the
-- contact guard (the caller holds the users' mail.contact locks, has re-checked the policy and holds
-- the addresses). ON CONFLICT DO NOTHING on the live (user, campaign) key: if RETURNING gives back
-- fewer rows than the page, the caller rolls back to its savepoint and re-renders the batch for the
-- rows that can be claimed (a batch never names a row it does not hold). The 'minted' event is
-- appended in the same statement.
with minted as (
    insert into mail.send_log (id, user_id, campaign, kind, email, email_key, context, status, claimed_at,
                               attempts, idempotency_key, batch_index,
                               dag_id, run_id, task_id, data_interval_start, data_interval_end)
    overriding system value
    select p.id, p.user_id, %(campaign)s, 'lifecycle', p.email, p.email_key, p.context, 'sending', now(), 1,
           %(key)s, p.idx, %(dag_id)s, %(run_id)s, %(task_id)s, %(interval_start)s, %(interval_end)s
    from jsonb_to_recordset(%(page)s::jsonb)
         as p(id bigint, user_id bigint, email text, email_key text, context jsonb, idx smallint)
    order by p.user_id
    on conflict (user_id, campaign) where released_at is null do nothing
    returning id, user_id
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, dag_id, run_id, task_id)
    select id, null, 'sending', 1, %(dag_id)s, %(run_id)s, %(task_id)s from minted
)
select user_id from minted

-- name: save_batch_keyed
-- Keep the exact request bytes of a batch under the key the store derived from them
-- (mf-<installation id>-<campaign tag>-<batch serial>-<16 hex of sha256(body)>, the format of
-- send_log.save_batch; the serial comes from mint.allocate). Any later retry resends these bytes.
-- key_identity: the sending API key's identity (a resend must use the same key).
-- campaign_content_hash: the campaign content the bytes were rendered from (with the bytes, never apart).
insert into mail.send_batch (idempotency_key, campaign, email_count, body, validation, key_identity,
                             campaign_content_hash)
values (%(key)s, %(campaign)s, %(count)s, %(body)s, %(validation)s, %(key_identity)s, %(content_hash)s)

-- name: rejected_of_run
-- Normalised addresses the provider rejected earlier in this run (any campaign), read once per run
-- by a store; the store adds each rejection it applies, so a lower-priority campaign does not try
-- them again in the same run (the per-chunk lookup this replaced cost ~1-2 ms a chunk).
select distinct email_key from mail.send_log
where run_id = %(run_id)s and email_key is not null
  and status = 'failed' and released_at is null and dead_lettered_at is null and attempts > 0
