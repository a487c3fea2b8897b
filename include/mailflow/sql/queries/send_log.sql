-- name: save_batch
-- Keep the exact request bytes of a batch: any later retry (reconciler) resends these bytes.
insert into mail.send_batch (idempotency_key, campaign, email_count, body)
values (%(key)s, %(campaign)s, %(count)s, %(body)s)

-- name: assign_batch
-- Record each row's batch and request index (request index i = row_ids[i]).
update mail.send_log l
set idempotency_key = %(key)s, batch_index = b.idx
from unnest(%(ids)s::bigint[], %(idx)s::int[]) as b(id, idx)
where l.id = b.id and l.status = 'sending'

-- name: mark_sent
-- Accepted by the provider: sending -> sent with its provider id. Guarded on the current state,
-- so a retried apply or a concurrent reconciler changes nothing twice.
with changed as (
    update mail.send_log l
    set status = 'sent', provider_message_id = a.pid, sent_at = now(), error = null
    from unnest(%(ids)s::bigint[], %(pids)s::text[]) as a(id, pid)
    where l.id = a.id and l.status = 'sending'
    returning l.id, l.attempts, l.provider_message_id
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, provider_message_id, dag_id, run_id, task_id)
select id, 'sending', 'sent', attempts, provider_message_id, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: mark_failed
-- Rejected by the provider (this exact email): sending -> failed with the provider's message.
-- The row keeps the unique key: the same address is not retried by the next run.
with changed as (
    update mail.send_log l
    set status = 'failed', error = a.msg
    from unnest(%(ids)s::bigint[], %(msgs)s::text[]) as a(id, msg)
    where l.id = a.id and l.status = 'sending'
    returning l.id, l.attempts, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', 'failed', attempts, error, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: release
-- The whole request certainly failed (nothing delivered).
-- Lifecycle rows: sending -> failed with released_at set, which takes the row out of the unique
-- key so the next run's audience decides again whether the user still qualifies (the row stays
-- as history; max_attempts such failures exclude the user, see lifecycle.eligible).
-- Scheduled rows: sending -> pending again, due after a backoff of 2^attempts minutes, keeping
-- their place in the plan; with attempts exhausted: failed and dead-lettered.
with changed as (
    update mail.send_log l
    set status = case when l.kind = 'scheduled' and l.attempts < %(max_attempts)s then 'pending' else 'failed' end,
        released_at = case when l.kind = 'lifecycle' then now() end,
        dead_lettered_at = case when l.kind = 'scheduled' and l.attempts >= %(max_attempts)s then now() end,
        scheduled_at = case when l.kind = 'scheduled'
                            then greatest(l.scheduled_at, now() + make_interval(mins => power(2, l.attempts)::int))
                            else l.scheduled_at end,
        idempotency_key = case when l.kind = 'scheduled' then null else l.idempotency_key end,
        batch_index = case when l.kind = 'scheduled' then null else l.batch_index end,
        error = %(reason)s
    where l.id = any(%(ids)s::bigint[]) and l.status = 'sending'
    returning l.id, l.attempts, l.status
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', status, attempts, %(reason)s, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: note_unknown
-- The outcome is unknown: the rows stay 'sending' (the reconciler resends the same bytes under the
-- same key); the reason is recorded on the row and as an event.
with changed as (
    update mail.send_log l
    set error = %(reason)s
    where l.id = any(%(ids)s::bigint[]) and l.status = 'sending'
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', 'sending', attempts, %(reason)s, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id
