-- name: insert_test_email
-- A test email about to be requested (status sending), with the tag id it carries: written and committed
-- before the request, so a webhook that beats the provider's answer finds it by the tag.
insert into mail.test_email (campaign_id, tag, email, email_key, to_masked, subject, status)
values (%(campaign_id)s, %(tag)s, %(email)s, %(email_key)s, %(to_masked)s, %(subject)s, 'sending')
returning id

-- name: accepted
-- The provider accepted the test email: its id, status sent, and the campaign event test_email that records
-- it (one statement: the event and the link commit together). The provider id may have been learnt from a
-- webhook already (the same id).
with ev as (
    insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
    select t.campaign_id, %(status)s, %(status)s, %(detail)s, %(actor)s
    from mail.test_email t
    where t.id = %(id)s
    returning id
)
update mail.test_email t
set provider_message_id = %(pid)s, status = 'sent', sent_at = now(), campaign_event_id = (select id from ev)
where t.id = %(id)s
returning t.campaign_event_id

-- name: not_accepted
-- The provider did not accept the test email: not_sent (proven not processed), refused or unknown (no answer:
-- it may have been delivered, and a webhook may still name it by its tag).
update mail.test_email set status = %(status)s where id = %(id)s and status = 'sending'

-- name: find
-- The test emails these reports may be about: by the provider's email id (unique) or by our tag (unique),
-- with the campaign's name for the decisions' texts.
select t.id, t.tag, t.provider_message_id, t.email, t.to_masked, c.name
from mail.test_email t
join mail.campaign c on c.id = t.campaign_id
where t.provider_message_id = any(%(pids)s::text[]) or t.tag = any(%(tags)s::text[])

-- name: learn_provider_ids
-- Test emails matched by their tag before the provider's answer stored their id: the id the webhook names.
-- Key order: concurrent writers lock in one order.
update mail.test_email t
set provider_message_id = d.pid
from (select * from unnest(%(ids)s::bigint[], %(pids)s::text[]) as d(id, pid) order by d.id) d
where t.id = d.id and t.provider_message_id is null

-- name: record_events
-- Record reports as events of their test emails and fold them into the test email's outcome columns, as
-- one statement for a group. A replay adds nothing (test_email_event.svix_id is unique; only the events
-- inserted now are folded). Order does not matter, as for mail.delivery_status (queries/outcomes.sql,
-- record_events): each time column takes the earliest report, opens and clicks add up, and the outcome
-- follows precedence (mail.delivery_outcome). RETURNING the svix-ids recorded now.
with reported as (
    select *
    from unnest(%(ids)s::bigint[], %(pids)s::text[], %(events)s::text[], %(bounce_types)s::text[],
                %(occurred)s::timestamptz[], %(svix_ids)s::text[])
         as r(test_email_id, pid, event, bounce_type, occurred_at, svix_id)
), new_event as (
    insert into mail.test_email_event (test_email_id, provider_message_id, event, bounce_type, occurred_at, svix_id)
    select r.test_email_id, r.pid, r.event, r.bounce_type, coalesce(r.occurred_at, now()), r.svix_id
    from reported r
    order by r.svix_id
    on conflict (svix_id) do nothing
    returning test_email_id, event, bounce_type, occurred_at, svix_id
), per_email as (
    select e.test_email_id,
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
           (count(*) filter (where e.event = 'opened'))::integer as opens,
           (count(*) filter (where e.event = 'clicked'))::integer as clicks
    from new_event e
    group by e.test_email_id
), folded as (
    update mail.test_email t set
        delivered_at     = least(t.delivered_at, p.delivered_at),
        hard_bounced_at  = least(t.hard_bounced_at, p.hard_bounced_at),
        soft_bounced_at  = least(t.soft_bounced_at, p.soft_bounced_at),
        complained_at    = least(t.complained_at, p.complained_at),
        failed_at        = least(t.failed_at, p.failed_at),
        delayed_at       = least(t.delayed_at, p.delayed_at),
        suppressed_at    = least(t.suppressed_at, p.suppressed_at),
        first_opened_at  = least(t.first_opened_at, p.first_opened_at),
        first_clicked_at = least(t.first_clicked_at, p.first_clicked_at),
        opens            = t.opens + p.opens,
        clicks           = t.clicks + p.clicks,
        outcome          = mail.delivery_outcome(
            least(t.complained_at, p.complained_at), least(t.hard_bounced_at, p.hard_bounced_at),
            least(t.suppressed_at, p.suppressed_at), least(t.failed_at, p.failed_at),
            least(t.delivered_at, p.delivered_at), least(t.soft_bounced_at, p.soft_bounced_at),
            least(t.delayed_at, p.delayed_at)),
        outcome_at       = case when mail.delivery_outcome(
            least(t.complained_at, p.complained_at), least(t.hard_bounced_at, p.hard_bounced_at),
            least(t.suppressed_at, p.suppressed_at), least(t.failed_at, p.failed_at),
            least(t.delivered_at, p.delivered_at), least(t.soft_bounced_at, p.soft_bounced_at),
            least(t.delayed_at, p.delayed_at)) is distinct from t.outcome then now() else t.outcome_at end
    from (select * from per_email order by test_email_id) p
    where t.id = p.test_email_id
    returning t.id
)
select e.svix_id, (select count(*) from folded) as folded
from new_event e

-- name: of_campaign
-- A campaign's test emails, oldest first, with their outcome columns and the events recorded (in the order
-- they happened): what the plan and `mailflow campaign status` show (test_email_campaign_idx).
select t.id, t.campaign_event_id, t.to_masked, t.subject, t.status, t.provider_message_id, t.created_at,
       t.sent_at, t.outcome, t.delivered_at, t.hard_bounced_at, t.soft_bounced_at, t.complained_at, t.failed_at,
       t.delayed_at, t.suppressed_at, t.first_opened_at, t.first_clicked_at, t.opens, t.clicks,
       coalesce((select array_agg(e.event || coalesce(' (' || e.bounce_type || ')', '') order by e.occurred_at, e.id)
                 from mail.test_email_event e where e.test_email_id = t.id), '{}') as events
from mail.test_email t
where t.campaign_id = %(campaign_id)s
order by t.created_at, t.id

-- name: suppressed_as
-- Whether a mailbox is suppressed for all mail or for the campaign (suppression_email_key_scope_uq): a test
-- email is not sent to it. The strongest reason first.
select source
from mail.suppression
where email_key = %(key)s and scope in ('all', %(campaign)s)
order by scope = 'all' desc, id
limit 1
