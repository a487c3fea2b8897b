-- name: promote_with_provider_id
-- A stale 'sending' row that already carries a provider id was accepted: sending -> sent.
with changed as (
    update mail.send_log l
    set status = 'sent', sent_at = coalesce(l.sent_at, now()), error = null
    where l.status = 'sending' and l.provider_message_id is not null and l.claimed_at < %(stale_before)s
    returning l.id, l.attempts, l.provider_message_id
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, provider_message_id, error, dag_id, run_id, task_id)
select id, 'sending', 'sent', attempts, provider_message_id, 'reconciler: provider id already recorded',
       %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: release_unbatched
-- A stale 'sending' row with no stored batch was never requested (defensive: mint and batch are
-- one transaction): rolled back like a whole-request failure.
with changed as (
    update mail.send_log l
    set status = 'failed', released_at = now(), error = 'reconciler: claimed but never requested'
    where l.status = 'sending' and l.idempotency_key is null and l.claimed_at < %(stale_before)s
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', 'failed', attempts, 'reconciler: claimed but never requested', %(dag_id)s, %(run_id)s, %(task_id)s
from changed
returning send_log_id

-- name: fail_past_window
-- A stale 'sending' row whose batch is older than the provider's idempotency window (24 h) is
-- never resent under a new key: failed with "unknown outcome" and dead-lettered for a person.
with changed as (
    update mail.send_log l
    set status = 'failed', dead_lettered_at = now(),
        error = 'unknown outcome: the provider may or may not have accepted it; its idempotency key '
                || l.idempotency_key || ' is past the idempotency window, so it is not resent (a person must decide)'
    from mail.send_batch b
    where b.idempotency_key = l.idempotency_key
      and l.status = 'sending' and l.claimed_at < %(stale_before)s and b.created_at < %(window_start)s
    returning l.id, l.attempts, l.error, l.user_id, l.campaign, l.email
)
, ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
    select id, 'sending', 'failed', attempts, error, %(dag_id)s, %(run_id)s, %(task_id)s from changed
)
select id, user_id, campaign, email, error from changed

-- name: stale_batches
-- Batches with stale 'sending' rows still inside the idempotency window, oldest first, that can be
-- resent under their own API key: its identity is one of %(identities)s (the current key and the
-- previous keys), or unknown (null: stored before 0015, resent under the current key), or any
-- identity when %(identities)s is null (a sender without identities, e.g. a test double).
select b.idempotency_key, b.campaign, b.body, b.email_count, b.validation, b.key_identity
from mail.send_batch b
where b.created_at >= %(window_start)s
  and (%(identities)s::text[] is null or b.key_identity is null or b.key_identity = any(%(identities)s::text[]))
  and exists (select 1 from mail.send_log l
              where l.idempotency_key = b.idempotency_key and l.status = 'sending'
                and l.claimed_at < %(stale_before)s)
order by b.created_at
limit %(limit)s

-- name: claim_stale_batch
-- Re-claim a stale batch's rows (conditional: a concurrent reconciler or a live worker wins,
-- and then this returns nothing). Returns every row of the batch in request order, so the
-- response can be reconciled by index.
-- A stale batch's sender is gone and may have written its request before it died, so the rows
-- become ambiguous here (ambiguous_at): whatever answers the resend, only a 2xx resolves them.
with claimed as (
    update mail.send_log l
    set claimed_at = now(), attempts = l.attempts + 1, ambiguous_at = coalesce(l.ambiguous_at, now())
    where l.idempotency_key = %(key)s and l.status = 'sending' and l.claimed_at < %(stale_before)s
    returning l.id
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
    select l.id, 'sending', 'sending', l.attempts + 1, 'reconciler: resending the same bytes under the same key',
           %(dag_id)s, %(run_id)s, %(task_id)s
    from mail.send_log l join claimed c on c.id = l.id
)
select l.id, l.batch_index, l.status, (l.id in (select id from claimed)) as claimed
from mail.send_log l
where l.idempotency_key = %(key)s
order by l.batch_index

-- name: held_batches
-- Stale batches inside the idempotency window whose API key identity is configured neither as the
-- current key nor as a previous one: never resent under another key (the provider scopes
-- idempotency keys per key, so that could deliver twice); held for a person (docs/operations.md,
-- "Rotating the API key"), and dead-lettered past the window like any stale batch.
select b.idempotency_key, b.campaign, b.key_identity, b.created_at,
       (select count(*) from mail.send_log l where l.idempotency_key = b.idempotency_key and l.status = 'sending')
from mail.send_batch b
where b.created_at >= %(window_start)s
  and b.key_identity is not null and not (b.key_identity = any(%(identities)s::text[]))
  and exists (select 1 from mail.send_log l
              where l.idempotency_key = b.idempotency_key and l.status = 'sending'
                and l.claimed_at < %(stale_before)s)
order by b.created_at

-- name: forget_key_identities
-- What this reconcile run found configured (read by `mailflow keys`), step 1: forget the rest.
delete from mail.api_key_identity where not (identity = any(%(identities)s::text[]))

-- name: record_key_identities
-- Step 2: the current key first in %(identities)s (distinct), then the previous keys.
insert into mail.api_key_identity (identity, role)
select i, case when n = 1 then 'current' else 'previous' end
from unnest(%(identities)s::text[]) with ordinality as t(i, n)
on conflict (identity) do update set role = excluded.role, seen_at = now()
