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
-- Batches with stale 'sending' rows still inside the idempotency window, oldest first.
select b.idempotency_key, b.campaign, b.body, b.email_count, b.validation
from mail.send_batch b
where b.created_at >= %(window_start)s
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
