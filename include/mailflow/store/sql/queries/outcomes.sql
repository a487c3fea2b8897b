-- name: sent_by_provider_id
-- The send-log rows of these provider email ids (send_log_provider_id_uq: one row per id at most), with
-- the address the recipient check compares against and the campaign the reputation guard evaluates.
select id, provider_message_id, email, campaign, user_id, status
from mail.send_log
where provider_message_id = any(%(pids)b::text[])

-- name: record_events
-- Record provider reports as typed events of their emails and fold them into mail.delivery_status, as one
-- statement for a whole group. Replays add nothing: delivery_event.svix_id is unique (ON CONFLICT DO
-- NOTHING) and only the rows inserted now reach the status, so an open is counted once per webhook.
-- Order does not matter: every time column takes least(existing, new), the counts add, and the outcome is
-- recomputed from the columns by precedence (mail.delivery_outcome), never from the latest arrival. A hard
-- bounce is bounced with bounce_type Permanent, or null (a poll: Resend's last_event bounced is permanent);
-- opened and clicked imply delivered (at their own time, if no earlier delivery is known). Opens and clicks
-- are counted for webhooks only (a poll says "opened" without saying how often). Rows are written in
-- svix_id, then send_log_id order, so concurrent groups lock them in one order (no deadlock between them).
-- A row created here has never been polled (checks 0, no poll times, last_event 'webhook').
with reported as (
    select *
    from unnest(%(send_log_ids)b::bigint[], %(pids)b::text[], %(events)b::text[], %(bounce_types)b::text[],
                %(occurred)b::timestamptz[], %(sources)b::text[], %(svix_ids)b::text[])
         as r(send_log_id, pid, event, bounce_type, occurred_at, source, svix_id)
), new_event as (
    insert into mail.delivery_event (send_log_id, provider_message_id, event, bounce_type, occurred_at, source, svix_id)
    select r.send_log_id, r.pid, r.event, r.bounce_type, coalesce(r.occurred_at, now()), r.source, r.svix_id
    from reported r
    order by r.svix_id, r.send_log_id
    on conflict (svix_id) do nothing
    returning send_log_id, provider_message_id, event, bounce_type, occurred_at, source, svix_id
), per_email as (
    select e.send_log_id,
           min(e.provider_message_id) as pid,
           min(e.occurred_at) filter (where e.event in ('delivered', 'opened', 'clicked')) as delivered_at,
           min(e.occurred_at) filter (where e.event = 'bounced'
                                        and coalesce(e.bounce_type, 'Permanent') = 'Permanent') as hard_bounced_at,
           min(e.occurred_at) filter (where e.event = 'bounced' and e.bounce_type <> 'Permanent') as soft_bounced_at,
           min(e.occurred_at) filter (where e.event = 'complained') as complained_at,
           min(e.occurred_at) filter (where e.event = 'failed') as failed_at,
           min(e.occurred_at) filter (where e.event = 'delivery_delayed') as delayed_at,
           min(e.occurred_at) filter (where e.event = 'suppressed') as suppressed_at,
           min(e.occurred_at) filter (where e.event = 'opened') as first_opened_at,
           min(e.occurred_at) filter (where e.event = 'clicked') as first_clicked_at,
           (count(*) filter (where e.event = 'opened' and e.source = 'webhook'))::integer as opens,
           (count(*) filter (where e.event = 'clicked' and e.source = 'webhook'))::integer as clicks
    from new_event e
    group by e.send_log_id
), status as (
    insert into mail.delivery_status as ds (
        send_log_id, provider_message_id, last_event, final, checks, first_checked_at, checked_at,
        delivered_at, hard_bounced_at, soft_bounced_at, complained_at, failed_at, delayed_at, suppressed_at,
        first_opened_at, first_clicked_at, opens, clicks, outcome, outcome_at)
    select p.send_log_id, p.pid, 'webhook', false, 0, null, null,
           p.delivered_at, p.hard_bounced_at, p.soft_bounced_at, p.complained_at, p.failed_at, p.delayed_at,
           p.suppressed_at, p.first_opened_at, p.first_clicked_at, p.opens, p.clicks,
           mail.delivery_outcome(p.complained_at, p.hard_bounced_at, p.suppressed_at, p.failed_at, p.delivered_at,
                                 p.soft_bounced_at, p.delayed_at),
           case when mail.delivery_outcome(p.complained_at, p.hard_bounced_at, p.suppressed_at, p.failed_at,
                                           p.delivered_at, p.soft_bounced_at, p.delayed_at) is not null
                then now() end
    from per_email p
    order by p.send_log_id
    on conflict (send_log_id) do update set
        delivered_at     = least(ds.delivered_at, excluded.delivered_at),
        hard_bounced_at  = least(ds.hard_bounced_at, excluded.hard_bounced_at),
        soft_bounced_at  = least(ds.soft_bounced_at, excluded.soft_bounced_at),
        complained_at    = least(ds.complained_at, excluded.complained_at),
        failed_at        = least(ds.failed_at, excluded.failed_at),
        delayed_at       = least(ds.delayed_at, excluded.delayed_at),
        suppressed_at    = least(ds.suppressed_at, excluded.suppressed_at),
        first_opened_at  = least(ds.first_opened_at, excluded.first_opened_at),
        first_clicked_at = least(ds.first_clicked_at, excluded.first_clicked_at),
        opens            = ds.opens + excluded.opens,
        clicks           = ds.clicks + excluded.clicks,
        outcome          = mail.delivery_outcome(
            least(ds.complained_at, excluded.complained_at), least(ds.hard_bounced_at, excluded.hard_bounced_at),
            least(ds.suppressed_at, excluded.suppressed_at), least(ds.failed_at, excluded.failed_at),
            least(ds.delivered_at, excluded.delivered_at), least(ds.soft_bounced_at, excluded.soft_bounced_at),
            least(ds.delayed_at, excluded.delayed_at)),
        outcome_at       = case when mail.delivery_outcome(
            least(ds.complained_at, excluded.complained_at), least(ds.hard_bounced_at, excluded.hard_bounced_at),
            least(ds.suppressed_at, excluded.suppressed_at), least(ds.failed_at, excluded.failed_at),
            least(ds.delivered_at, excluded.delivered_at), least(ds.soft_bounced_at, excluded.soft_bounced_at),
            least(ds.delayed_at, excluded.delayed_at)) is distinct from ds.outcome then now() else ds.outcome_at end
    returning ds.send_log_id
)
select e.send_log_id, e.svix_id, (select count(*) from status) as statuses
from new_event e

-- name: suppress_addresses
-- Suppress the mailboxes that hard-bounced, complained or are on the provider's list, for all mail, as one
-- statement (keys computed in Python: mailflow.store.policy.mailbox_key; one row per key, deduplicated by
-- the caller). ON CONFLICT on suppression_email_key_scope_uq: a mailbox is suppressed once; a feedback
-- suppression is upgraded to a stronger feedback source (complaint > bounce > provider_suppressed, the
-- outcome precedence), so the row ends the same whatever order the reports came in; any other source
-- (an unsubscribe, an operator) is left as it is. Key order: concurrent writers lock in one order.
-- RETURNING: inserted = true for a new suppression, false for an upgraded one; a key not returned was
-- already suppressed as strongly.
insert into mail.suppression as s (email, email_key, scope, source, reason)
select r.email, r.k, 'all', r.source, r.reason
from unnest(%(emails)s::text[], %(keys)s::text[], %(sources)s::text[], %(reasons)s::text[])
     as r(email, k, source, reason)
order by r.k
on conflict (email_key, scope) where email_key is not null do update
    set source = excluded.source, reason = excluded.reason
    where s.source in ('provider_suppressed', 'bounce', 'complaint')
      and array_position(array['provider_suppressed', 'bounce', 'complaint'], excluded.source)
          > array_position(array['provider_suppressed', 'bounce', 'complaint'], s.source)
returning s.email_key, (s.xmax = 0) as inserted

-- name: record_decisions
-- Feedback decisions (suppressed, already suppressed, recipient mismatch, failed) as events of their emails:
-- sent -> sent (the row stays sent: the provider accepted its request), the decision in error, the provider
-- id, and the Airflow run that decided (null for the webhook receiver). Only for rows still sent; in the
-- order given.
insert into mail.send_event (send_log_id, from_status, to_status, error, provider_message_id, dag_id, run_id, task_id)
select l.id, 'sent', 'sent', d.decision, d.pid, %(dag_id)s, %(run_id)s, %(task_id)s
from unnest(%(ids)s::bigint[], %(pids)s::text[], %(decisions)s::text[]) with ordinality as d(id, pid, decision, n)
join mail.send_log l on l.id = d.id and l.status = 'sent'
order by d.n
