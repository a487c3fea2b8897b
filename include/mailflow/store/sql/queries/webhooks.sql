-- name: insert_events
-- A group of verified webhooks into the receiver's inbox, one row per svix-id (the provider delivers at least
-- once: ON CONFLICT on the primary key does nothing, so a retry changes nothing). The decision is the one
-- applying will make in the same transaction (null: the email is not in the send log yet, attempts 1: the
-- sweep tries again). RETURNING names the rows inserted now: only they are applied. Key order: concurrent
-- groups lock in one order.
insert into mail.webhook_event (svix_id, event_type, provider_message_id, occurred_at, payload, applied_at,
                                attempts, decision)
select e.svix_id, e.event_type, e.pid, e.occurred_at, e.payload::jsonb,
       case when e.decision is not null then now() end, e.attempts, e.decision
from unnest(%(svix_ids)b::text[], %(types)b::text[], %(pids)b::text[], %(occurred)b::timestamptz[],
            %(payloads)b::text[], %(decisions)b::text[], %(attempts)b::integer[])
     as e(svix_id, event_type, pid, occurred_at, payload, decision, attempts)
order by e.svix_id
on conflict (svix_id) do nothing
returning svix_id

-- name: set_decisions
-- Correct the decision of inbox rows whose application decided otherwise than expected (an outcome recorded
-- before: duplicate_outcome), or decide rows the sweep applied now. Only rows still undecided or decided in
-- this transaction are passed.
update mail.webhook_event w
set decision = d.decision, applied_at = coalesce(w.applied_at, now())
from unnest(%(svix_ids)s::text[], %(decisions)s::text[]) as d(svix_id, decision)
where w.svix_id = d.svix_id

-- name: pending_events
-- Inbox rows still waiting for their email (applied_at null), fewest attempts first, then the oldest, so one
-- old backlog cannot starve newer events (webhook_event_pending_idx). FOR UPDATE SKIP LOCKED: two sweeps
-- (the receiver's loop, the DAG) never take the same row; a row the receiver is inserting is not seen yet.
-- expired: older than the give-up age (decided unknown_email).
select svix_id, event_type, provider_message_id, occurred_at, payload,
       received_at < now() - make_interval(secs => %(give_up_seconds)s) as expired
from mail.webhook_event
where applied_at is null
order by attempts, received_at
limit %(limit)s
for update skip locked

-- name: count_attempts
-- One more apply attempt for inbox rows whose email is still not in the send log.
update mail.webhook_event set attempts = attempts + 1 where svix_id = any(%(svix_ids)s::text[])

-- name: unalerted_decisions
-- Decisions a person must see (recipient mismatches, provider failures, emails never found) not alerted yet,
-- oldest first (webhook_event_alert_idx), with the send-log row or the test email the provider id points at
-- (if any) for the alert line. FOR UPDATE OF w SKIP LOCKED: two alerting runs never report the same row.
select w.svix_id, w.event_type, w.provider_message_id, w.decision, w.received_at, l.id, l.email,
       t.id, c.name, t.to_masked
from mail.webhook_event w
left join mail.send_log l on l.provider_message_id = w.provider_message_id
left join mail.test_email t on t.provider_message_id = w.provider_message_id
left join mail.campaign c on c.id = t.campaign_id
where w.alerted_at is null and w.decision in ('recipient_mismatch', 'failed', 'unknown_email')
order by w.received_at
limit %(limit)s
for update of w skip locked

-- name: mark_alerted
-- The rows an alert named: not alerted again.
update mail.webhook_event set alerted_at = now() where svix_id = any(%(svix_ids)s::text[])
