-- migrate: no-transaction
-- 0021: what happened to the emails after the provider accepted them, for analysts and the progress page.
--
-- * mail.campaign_outcomes_daily: per campaign and local day of sending, the sent emails and what the
--   provider reported about them since (mail.delivery_status, written by the webhook receiver and the
--   poll): delivered, hard and soft bounces, complaints, failures after acceptance, unique opens and
--   clicks, the emails with no final outcome yet, and each rate over sent.
-- * mail.campaign_outcomes: the same per campaign over its whole history, with the reputation guard's
--   state (mail.reputation_guard, campaign and account scope): what the progress page shows.
-- * mail.campaign_progress counts every state of the send log: total now includes duplicate and skipped
--   rows (terminal states since 0007), which get their own columns, as does invalid (the failed rows an
--   address check decided without a request); mailflow.model.tally is the same mapping in Python.
--
-- Read path: a campaign's sent emails are one range of send_log_campaign_sent_idx (campaign, sent_at),
-- which since this migration also holds the row id (INCLUDE), so the join to mail.delivery_status (its
-- primary key) needs no visit to the send log's heap: an index-only range plus one primary-key probe per
-- sent email. The index replaces 0009's (same rows, same key, 8 bytes more per entry: the write path keeps
-- its number of indexes), built CONCURRENTLY (no lock that blocks reads or writes of mail.send_log; an
-- interrupted build is dropped and rebuilt by mailflow.migrate), then the old one is dropped and the new
-- one takes its name. duplicate and skipped rows are counted through the partial index of cancelled rows,
-- widened to those two states (rare states: ~0 writes per chunk on the hot path). Run statement by
-- statement outside a transaction: the indexes first, so the views never run without them.

create index concurrently if not exists send_log_campaign_sent_id_idx on mail.send_log (campaign, sent_at)
    include (user_id, kind, id) where status = 'sent';
drop index concurrently if exists mail.send_log_campaign_sent_idx;
alter index if exists mail.send_log_campaign_sent_id_idx rename to send_log_campaign_sent_idx;

create index concurrently if not exists send_log_closed_idx on mail.send_log (campaign, minted_at)
    include (user_id, kind, status) where status in ('cancelled', 'duplicate', 'skipped');
drop index concurrently if exists mail.send_log_cancelled_idx;
alter index if exists mail.send_log_closed_idx rename to send_log_cancelled_idx;

-- mail.campaign_daily and mail.campaign_progress count every state of the send log (mailflow.model.tally):
-- duplicate and skipped rows (terminal since 0007) get their own columns, counted on the day of their event
-- (daily) and in total and done (progress); invalid is the failed rows decided without a request (an
-- invalid address: never claimed). New columns come last (CREATE OR REPLACE VIEW keeps the others).
create or replace view mail.campaign_daily as
select a.campaign,
       a.kind,
       coalesce(c.timezone, 'UTC')                                         as timezone,
       (a.at at time zone coalesce(c.timezone, 'UTC'))::date               as day,
       count(*) filter (where a.what = 'minted')                           as minted,
       count(*) filter (where a.what = 'sent')                             as sent,
       count(*) filter (where a.what = 'failed')                           as failed,
       count(*) filter (where a.what = 'rolled_back')                      as rolled_back,
       count(*) filter (where a.what = 'cancelled')                        as cancelled,
       count(*) filter (where a.what = 'dead_lettered')                    as dead_lettered,
       count(distinct a.user_id)                                           as unique_users,
       count(*) filter (where a.what = 'duplicate')                        as duplicate,
       count(*) filter (where a.what = 'skipped')                          as skipped
from (
    select l.campaign, l.kind, l.user_id, 'minted' as what, l.minted_at as at
    from mail.send_log l
    union all
    select l.campaign, l.kind, l.user_id, 'sent', l.sent_at
    from mail.send_log l
    where l.status = 'sent'
    union all
    select l.campaign, l.kind, l.user_id, x.what, x.at
    from mail.send_log l
    cross join lateral (values
        ('failed', case when l.released_at is null then coalesce(l.dead_lettered_at, l.claimed_at, l.minted_at) end),
        ('rolled_back', l.released_at),
        ('dead_lettered', l.dead_lettered_at)
    ) as x (what, at)
    where l.status = 'failed' and x.at is not null
    union all
    select l.campaign, l.kind, l.user_id, l.status,
           coalesce((select min(e.at) from mail.send_event e
                     where e.send_log_id = l.id and e.to_status = l.status), l.minted_at)
    from mail.send_log l
    where l.status in ('cancelled', 'duplicate', 'skipped')
) as a
left join mail.campaign c on a.kind = 'scheduled' and c.name = a.campaign
group by a.campaign, a.kind, coalesce(c.timezone, 'UTC'), (a.at at time zone coalesce(c.timezone, 'UTC'))::date;

create or replace view mail.campaign_progress as
with recursive seen (campaign) as (
    (select l.campaign from mail.send_log l order by l.campaign limit 1)
    union all
    select (select l.campaign from mail.send_log l where l.campaign > s.campaign order by l.campaign limit 1)
    from seen s
    where s.campaign is not null
)
select k.campaign,
       coalesce(f.kind, 'scheduled')                                          as kind,
       c.status                                                               as campaign_status,
       coalesce(c.timezone, 'UTC')                                            as timezone,
       o.pending + o.sending + st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped
                                                                              as total,
       o.pending, o.sending, st.sent, fl.failed, cn.cancelled, fl.rolled_back, fl.dead_lettered,
       st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped         as done,
       coalesce(round(100.0 * (st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped)
                      / nullif(o.pending + o.sending + st.sent + fl.failed + cn.cancelled + cn.duplicate
                               + cn.skipped, 0), 1), 0.0)
                                                                              as percent_done,
       st.sent_last_5m,
       round(r.per_min, 1)                                                    as send_rate_per_min,
       f.first_minted_at,
       st.last_sent_at,
       o.next_due_at,
       o.last_due_at,
       case when o.pending + o.sending = 0 then null
            when r.per_min > 0
                then greatest(now() + ((o.pending + o.sending) / r.per_min)::float8 * interval '1 minute',
                              o.last_due_at)
            else o.last_due_at
       end                                                                    as eta,
       (o.sending > 0 or (o.pending > 0 and c.status = 'scheduled'))          as active,
       cn.duplicate,
       cn.skipped,
       fl.invalid
from (select s.campaign from seen s where s.campaign is not null
      union
      select c.name from mail.campaign c) as k
left join lateral (select l.kind, l.minted_at as first_minted_at from mail.send_log l
                   where l.campaign = k.campaign order by l.minted_at limit 1) as f on true
cross join lateral (
    select count(*) filter (where l.status = 'pending')                         as pending,
           count(*) filter (where l.status = 'sending')                         as sending,
           min(l.scheduled_at) filter (where l.status = 'pending')              as next_due_at,
           max(l.scheduled_at) filter (where l.status = 'pending')              as last_due_at
    from mail.send_log l where l.campaign = k.campaign and l.status in ('pending', 'sending')) as o
cross join lateral (
    select count(*)                                                             as sent,
           count(*) filter (where l.sent_at >= now() - interval '5 minutes')    as sent_last_5m,
           min(l.sent_at) filter (where l.sent_at >= now() - interval '5 minutes') as window_first_sent,
           max(l.sent_at)                                                       as last_sent_at
    from mail.send_log l where l.campaign = k.campaign and l.status = 'sent') as st
cross join lateral (
    select count(*) filter (where l.released_at is null)                        as failed,
           count(*) filter (where l.released_at is not null)                    as rolled_back,
           count(*) filter (where l.dead_lettered_at is not null)               as dead_lettered,
           count(*) filter (where l.released_at is null and l.claimed_at is null) as invalid
    from mail.send_log l where l.campaign = k.campaign and l.status = 'failed') as fl
cross join lateral (
    select count(*) filter (where l.status = 'cancelled')                       as cancelled,
           count(*) filter (where l.status = 'duplicate')                       as duplicate,
           count(*) filter (where l.status = 'skipped')                         as skipped
    from mail.send_log l where l.campaign = k.campaign
                           and l.status in ('cancelled', 'duplicate', 'skipped')) as cn
cross join lateral (
    select st.sent_last_5m * 60.0 / greatest(extract(epoch from now() - st.window_first_sent), 30) as per_min
) as r
left join mail.campaign c on c.name = k.campaign;

comment on column mail.campaign_daily.duplicate is
    'Rows recorded that day as duplicate (another user of the campaign got it at the same normalised address).';
comment on column mail.campaign_daily.skipped is 'Rows skipped that day by the contact policy (the campaign skips held emails).';
comment on column mail.campaign_daily.minted is
    'Rows created that day (lifecycle: minted by a run, including those decided at once as failed or duplicate; '
    'scheduled: provisioned).';
comment on column mail.campaign_progress.total is
    'Emails of the campaign: pending + sending + sent + failed + cancelled + duplicate + skipped (rolled-back '
    'attempts excluded).';
comment on column mail.campaign_progress.done is 'sent + failed + cancelled + duplicate + skipped (terminal emails).';
comment on column mail.campaign_progress.duplicate is
    'Rows not sent because another user of the campaign got it at the same normalised address.';
comment on column mail.campaign_progress.skipped is 'Rows held back by the contact policy in a campaign that skips them.';
comment on column mail.campaign_progress.invalid is
    'Of failed: rows decided without a request because the address is invalid (never claimed).';

-- Per campaign and local day of sent_at (the campaign's timezone for scheduled campaigns, UTC otherwise,
-- as mail.campaign_daily). Each email is counted once per outcome it had (an email delivered, then
-- complained about, is in delivered and in complained); no_outcome_yet is the sent emails with no final
-- outcome. A filter on campaign is pushed into that campaign's range of send_log_campaign_sent_idx (index-only:
-- the row id is in the index), joined to delivery_status by its primary key or, for a large campaign, by
-- hashing it. Measured (3M send-log rows, 2.76M outcomes, one campaign of 742k sent emails, 2 shared
-- cores): about 3 s either way; the cost grows with the campaign's sent emails.
create or replace view mail.campaign_outcomes_daily as
select o.campaign,
       o.kind,
       o.timezone,
       o.day,
       o.sent,
       o.delivered,
       o.hard_bounced,
       o.soft_bounced,
       o.complained,
       o.failed_after_send,
       o.suppressed,
       o.unique_opens,
       o.unique_clicks,
       o.no_outcome_yet,
       round(o.delivered::numeric / nullif(o.sent, 0), 6)     as delivered_rate,
       round(o.hard_bounced::numeric / nullif(o.sent, 0), 6)  as hard_bounce_rate,
       round(o.complained::numeric / nullif(o.sent, 0), 6)    as complaint_rate,
       round(o.unique_opens::numeric / nullif(o.sent, 0), 6)  as open_rate,
       round(o.unique_clicks::numeric / nullif(o.sent, 0), 6) as click_rate
from (
    select l.campaign,
           l.kind,
           coalesce(c.timezone, 'UTC')                                         as timezone,
           (l.sent_at at time zone coalesce(c.timezone, 'UTC'))::date          as day,
           count(*)                                                            as sent,
           count(d.delivered_at)                                               as delivered,
           count(d.hard_bounced_at)                                            as hard_bounced,
           count(d.soft_bounced_at)                                            as soft_bounced,
           count(d.complained_at)                                              as complained,
           count(d.failed_at)                                                  as failed_after_send,
           count(d.suppressed_at)                                              as suppressed,
           count(d.first_opened_at)                                            as unique_opens,
           count(d.first_clicked_at)                                           as unique_clicks,
           count(*) filter (where d.outcome is null or d.outcome = 'delayed')  as no_outcome_yet
    from mail.send_log l
    left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
    left join mail.delivery_status d on d.send_log_id = l.id
    where l.status = 'sent'
    group by l.campaign, l.kind, coalesce(c.timezone, 'UTC'), (l.sent_at at time zone coalesce(c.timezone, 'UTC'))::date
) as o;

comment on view mail.campaign_outcomes_daily is
    'Per campaign and local day of sending: the emails the provider accepted (status sent) and what it reported '
    'about them since (mail.delivery_status: webhooks and the poll). Each email counts once per outcome it had; '
    'rates are fractions 0..1 of sent. Day = local date of sent_at in the scheduled campaign''s timezone, UTC '
    'otherwise. Filter by campaign (index-backed). See docs/send_log.md.';
comment on column mail.campaign_outcomes_daily.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.campaign_outcomes_daily.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_outcomes_daily.timezone is 'Timezone of day: the scheduled campaign''s IANA zone, or UTC.';
comment on column mail.campaign_outcomes_daily.day is 'Local calendar date (in timezone) on which the emails were sent (sent_at).';
comment on column mail.campaign_outcomes_daily.sent is 'Emails the provider accepted that day (status sent, by sent_at).';
comment on column mail.campaign_outcomes_daily.delivered is
    'Of those, emails delivered to the recipient''s server (delivered_at; an open or click implies it).';
comment on column mail.campaign_outcomes_daily.hard_bounced is
    'Of those, emails that bounced permanently (bounce type Permanent): the address is suppressed.';
comment on column mail.campaign_outcomes_daily.soft_bounced is
    'Of those, emails that bounced transiently or undetermined (not suppressed).';
comment on column mail.campaign_outcomes_daily.complained is 'Of those, emails the recipient marked as spam: the address is suppressed.';
comment on column mail.campaign_outcomes_daily.failed_after_send is
    'Of those, emails the provider accepted and then failed to send (event failed; alerted, not suppressed).';
comment on column mail.campaign_outcomes_daily.suppressed is
    'Of those, emails the provider did not send because the address is on its own suppression list.';
comment on column mail.campaign_outcomes_daily.unique_opens is 'Of those, emails opened at least once (first_opened_at).';
comment on column mail.campaign_outcomes_daily.unique_clicks is 'Of those, emails with at least one link clicked (first_clicked_at).';
comment on column mail.campaign_outcomes_daily.no_outcome_yet is
    'Of those, emails with no final outcome reported yet (nothing, or only delivery_delayed).';
comment on column mail.campaign_outcomes_daily.delivered_rate is 'delivered / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes_daily.hard_bounce_rate is 'hard_bounced / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes_daily.complaint_rate is 'complained / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes_daily.open_rate is 'unique_opens / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes_daily.click_rate is 'unique_clicks / sent (fraction 0..1, 6 decimals); null when sent = 0.';

-- Per campaign over its whole history, plus the reputation guard: one row per campaign with a sent email or
-- a guard row. The account scope is not tied to a campaign (the send log does not record the account an
-- email went through): every row shows whether any provider account is tripped, which stops every campaign.
-- The names come from a skip scan of send_log_campaign_sent_idx (one probe per campaign); each campaign's
-- outcomes are the daily view filtered on it (its own index range).
create or replace view mail.campaign_outcomes as
with recursive seen (campaign) as (
    (select l.campaign from mail.send_log l where l.status = 'sent' order by l.campaign limit 1)
    union all
    select (select l.campaign from mail.send_log l
            where l.status = 'sent' and l.campaign > s.campaign order by l.campaign limit 1)
    from seen s
    where s.campaign is not null
)
select k.campaign,
       o.kind,
       coalesce(o.sent, 0)                                            as sent,
       coalesce(o.delivered, 0)                                       as delivered,
       coalesce(o.hard_bounced, 0)                                    as hard_bounced,
       coalesce(o.soft_bounced, 0)                                    as soft_bounced,
       coalesce(o.complained, 0)                                      as complained,
       coalesce(o.failed_after_send, 0)                               as failed_after_send,
       coalesce(o.suppressed, 0)                                      as suppressed,
       coalesce(o.unique_opens, 0)                                    as unique_opens,
       coalesce(o.unique_clicks, 0)                                   as unique_clicks,
       coalesce(o.no_outcome_yet, 0)                                  as no_outcome_yet,
       round(o.delivered::numeric / nullif(o.sent, 0), 6)             as delivered_rate,
       round(o.hard_bounced::numeric / nullif(o.sent, 0), 6)          as hard_bounce_rate,
       round(o.complained::numeric / nullif(o.sent, 0), 6)            as complaint_rate,
       round(o.unique_opens::numeric / nullif(o.sent, 0), 6)          as open_rate,
       round(o.unique_clicks::numeric / nullif(o.sent, 0), 6)         as click_rate,
       coalesce(g.state, 'ok')                                        as guard_state,
       g.reason                                                       as guard_reason,
       g.tripped_at                                                   as guard_tripped_at,
       g.hard_bounce_rate                                             as guard_hard_bounce_rate,
       g.complaint_rate                                               as guard_complaint_rate,
       g.sample                                                       as guard_sample,
       a.state                                                        as account_guard_state,
       a.reason                                                       as account_guard_reason
from (select s.campaign from seen s where s.campaign is not null
      union
      select r.name from mail.reputation_guard r where r.scope = 'campaign') as k
left join lateral (
    select min(d.kind) as kind, sum(d.sent)::bigint as sent, sum(d.delivered)::bigint as delivered,
           sum(d.hard_bounced)::bigint as hard_bounced, sum(d.soft_bounced)::bigint as soft_bounced,
           sum(d.complained)::bigint as complained, sum(d.failed_after_send)::bigint as failed_after_send,
           sum(d.suppressed)::bigint as suppressed, sum(d.unique_opens)::bigint as unique_opens,
           sum(d.unique_clicks)::bigint as unique_clicks, sum(d.no_outcome_yet)::bigint as no_outcome_yet
    from mail.campaign_outcomes_daily d
    where d.campaign = k.campaign) as o on true
left join mail.reputation_guard g on g.scope = 'campaign' and g.name = k.campaign
cross join lateral (
    select case when count(*) > 0 then 'tripped' else 'ok' end as state,
           string_agg(r.name || ': ' || r.reason, '; ' order by r.name) as reason
    from mail.reputation_guard r
    where r.scope = 'account' and r.state = 'tripped') as a;

comment on view mail.campaign_outcomes is
    'Per campaign over its whole history: sent emails, their outcomes and rates (as mail.campaign_outcomes_daily, '
    'summed over days) and the reputation guard''s state for the campaign and for the provider accounts. '
    'Filter by campaign (index-backed).';
comment on column mail.campaign_outcomes.campaign is 'Campaign name.';
comment on column mail.campaign_outcomes.kind is 'lifecycle or scheduled; null for a campaign with a guard row and no sent email.';
comment on column mail.campaign_outcomes.sent is 'Emails the provider accepted (status sent).';
comment on column mail.campaign_outcomes.delivered is 'Of those, delivered (an open or click implies it).';
comment on column mail.campaign_outcomes.hard_bounced is 'Of those, bounced permanently (the address is suppressed).';
comment on column mail.campaign_outcomes.soft_bounced is 'Of those, bounced transiently or undetermined (not suppressed).';
comment on column mail.campaign_outcomes.complained is 'Of those, marked as spam (the address is suppressed).';
comment on column mail.campaign_outcomes.failed_after_send is 'Of those, failed by the provider after it accepted them.';
comment on column mail.campaign_outcomes.suppressed is 'Of those, not sent: the address is on the provider''s own suppression list.';
comment on column mail.campaign_outcomes.unique_opens is 'Of those, opened at least once.';
comment on column mail.campaign_outcomes.unique_clicks is 'Of those, clicked at least once.';
comment on column mail.campaign_outcomes.no_outcome_yet is 'Of those, no final outcome reported yet (nothing, or only delivery_delayed).';
comment on column mail.campaign_outcomes.delivered_rate is 'delivered / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes.hard_bounce_rate is 'hard_bounced / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes.complaint_rate is 'complained / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes.open_rate is 'unique_opens / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes.click_rate is 'unique_clicks / sent (fraction 0..1, 6 decimals); null when sent = 0.';
comment on column mail.campaign_outcomes.guard_state is
    'The reputation guard for this campaign: ok (may send; also when never evaluated) or tripped (sending stopped).';
comment on column mail.campaign_outcomes.guard_reason is 'Why the campaign''s guard tripped (rate, threshold, sample); null when ok and never tripped.';
comment on column mail.campaign_outcomes.guard_tripped_at is 'When the campaign''s guard last tripped (timestamptz, UTC).';
comment on column mail.campaign_outcomes.guard_hard_bounce_rate is
    'The guard''s rolling hard-bounce rate at its last evaluation (fraction 0..1; its window, not all history).';
comment on column mail.campaign_outcomes.guard_complaint_rate is
    'The guard''s rolling complaint rate at its last evaluation (fraction 0..1; its window, not all history).';
comment on column mail.campaign_outcomes.guard_sample is 'Emails with an outcome in the guard''s window at its last evaluation.';
comment on column mail.campaign_outcomes.account_guard_state is
    'tripped when any provider account''s guard is tripped (every campaign sending through it stops), else ok.';
comment on column mail.campaign_outcomes.account_guard_reason is 'The tripped accounts and why ("account: reason; ..."); null when ok.';
