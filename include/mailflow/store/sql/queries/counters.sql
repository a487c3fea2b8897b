-- name: seeded
-- Whether the counters hold the whole send log (migration 0028: seeded by the first fold, or at once on an
-- empty send log); until then readers use the views. One row.
select seeded_at is not null from mail.campaign_counter_state

-- name: day_seeded
-- Whether the day counters hold every sent email (migration 0031 seeds them with their first fold; until
-- then mail.campaign_outcomes_daily misses what the seed counts). One row.
select seeded_at is not null from mail.campaign_day_counter_state

-- name: fold
-- Fold the pending changes into mail.campaign_counter (0028) and mail.campaign_day_counter (0031; the first
-- call of each seeds it with a full count). Returns the delta rows folded of each, or null for one another
-- fold is running (it folds the same rows: nothing is lost).
select mail.fold_campaign_counters(), mail.fold_campaign_day_counters()

-- name: progress
-- mail.campaign_progress's columns, in its order, from the counters (mail.campaign_counts: folded counts
-- plus the unfolded deltas) instead of counting the campaign's rows: every campaign, or only
-- %(campaign)s. The counts read one counter row per (campaign, key); what depends on the clock is read
-- from the index ranges it needs, each bounded by the window or a LIMIT, not by the campaign's size:
-- the last 5 minutes of sends and the last send (send_log_campaign_sent_idx), the first row
-- (send_log_campaign_minted_idx) and the first and last pending planned time (send_log_campaign_open_idx,
-- whose rows are the open ones).
with k as (
    select x.campaign from mail.campaign_counts x
    where %(campaign)s::text is null or x.campaign = %(campaign)s
    group by x.campaign
    having bool_or(x.n <> 0)
    union
    select c.name from mail.campaign c where %(campaign)s::text is null or c.name = %(campaign)s
), n as (
    select k.campaign,
           coalesce(sum(x.n) filter (where x.key = 'pending'), 0)::bigint       as pending,
           coalesce(sum(x.n) filter (where x.key = 'sending'), 0)::bigint       as sending,
           coalesce(sum(x.n) filter (where x.key = 'sent'), 0)::bigint          as sent,
           coalesce(sum(x.n) filter (where x.key = 'failed'), 0)::bigint        as failed,
           coalesce(sum(x.n) filter (where x.key = 'cancelled'), 0)::bigint     as cancelled,
           coalesce(sum(x.n) filter (where x.key = 'duplicate'), 0)::bigint     as duplicate,
           coalesce(sum(x.n) filter (where x.key = 'skipped'), 0)::bigint       as skipped,
           coalesce(sum(x.n) filter (where x.key = 'holdout'), 0)::bigint       as holdout,
           coalesce(sum(x.n) filter (where x.key = 'invalid'), 0)::bigint       as invalid,
           coalesce(sum(x.n) filter (where x.key = 'dead_lettered'), 0)::bigint as dead_lettered,
           coalesce(sum(x.n) filter (where x.key = 'rolled_back'), 0)::bigint   as rolled_back
    from k
    left join mail.campaign_counts x on x.campaign = k.campaign
    group by k.campaign
)
select n.campaign,
       coalesce(f.kind, 'scheduled')                                          as kind,
       c.status                                                               as campaign_status,
       coalesce(c.timezone, 'UTC')                                            as timezone,
       n.pending + n.sending + n.sent + n.failed + n.cancelled + n.duplicate + n.skipped + n.holdout
                                                                              as total,
       n.pending, n.sending, n.sent, n.failed, n.cancelled, n.rolled_back, n.dead_lettered,
       n.sent + n.failed + n.cancelled + n.duplicate + n.skipped + n.holdout as done,
       coalesce(round(100.0 * (n.sent + n.failed + n.cancelled + n.duplicate + n.skipped + n.holdout)
                      / nullif(n.pending + n.sending + n.sent + n.failed + n.cancelled + n.duplicate
                               + n.skipped + n.holdout, 0), 1), 0.0)
                                                                              as percent_done,
       w.sent_last_5m,
       round(r.per_min, 1)                                                    as send_rate_per_min,
       f.first_minted_at,
       (select max(l.sent_at) from mail.send_log l
        where l.campaign = n.campaign and l.status = 'sent')                   as last_sent_at,
       d.next_due_at,
       d.last_due_at,
       case when n.pending + n.sending = 0 then null
            when r.per_min > 0
                then greatest(now() + ((n.pending + n.sending) / r.per_min)::float8 * interval '1 minute',
                              d.last_due_at)
            else d.last_due_at
       end                                                                    as eta,
       (n.sending > 0 or (n.pending > 0 and c.status = 'scheduled'))          as active,
       n.duplicate,
       n.skipped,
       n.invalid,
       n.holdout
from n
left join lateral (select l.kind, l.minted_at as first_minted_at from mail.send_log l
                   where l.campaign = n.campaign order by l.minted_at limit 1) as f on true
cross join lateral (
    select count(*)       as sent_last_5m,
           min(l.sent_at) as window_first_sent
    from mail.send_log l
    where l.campaign = n.campaign and l.status = 'sent' and l.sent_at >= now() - interval '5 minutes') as w
cross join lateral (
    select (select l.scheduled_at from mail.send_log l
            where l.campaign = n.campaign and l.status = 'pending' and l.scheduled_at is not null
            order by l.scheduled_at limit 1)      as next_due_at,
           (select l.scheduled_at from mail.send_log l
            where l.campaign = n.campaign and l.status = 'pending' and l.scheduled_at is not null
            order by l.scheduled_at desc limit 1) as last_due_at) as d
cross join lateral (
    select w.sent_last_5m * 60.0 / greatest(extract(epoch from now() - w.window_first_sent), 30) as per_min
) as r
left join mail.campaign c on c.name = n.campaign
order by n.campaign

-- name: outcomes
-- The columns of mail.campaign_outcomes the page and the report read, from the counters: one row per
-- campaign with a sent email or a campaign guard row (as the view), every campaign or only %(campaign)s.
-- Counts are the counter rows; no_outcome_yet = sent - with_outcome.
with n as (
    select x.campaign,
           coalesce(sum(x.n) filter (where x.key = 'sent'), 0)::bigint              as sent,
           coalesce(sum(x.n) filter (where x.key = 'delivered'), 0)::bigint         as delivered,
           coalesce(sum(x.n) filter (where x.key = 'hard_bounced'), 0)::bigint      as hard_bounced,
           coalesce(sum(x.n) filter (where x.key = 'soft_bounced'), 0)::bigint      as soft_bounced,
           coalesce(sum(x.n) filter (where x.key = 'complained'), 0)::bigint        as complained,
           coalesce(sum(x.n) filter (where x.key = 'failed_after_send'), 0)::bigint as failed_after_send,
           coalesce(sum(x.n) filter (where x.key = 'suppressed'), 0)::bigint        as suppressed,
           coalesce(sum(x.n) filter (where x.key = 'unique_opens'), 0)::bigint      as unique_opens,
           coalesce(sum(x.n) filter (where x.key = 'unique_clicks'), 0)::bigint     as unique_clicks,
           coalesce(sum(x.n) filter (where x.key = 'with_outcome'), 0)::bigint      as with_outcome,
           coalesce(sum(x.n) filter (where x.key = 'holdout'), 0)::bigint           as holdout
    from mail.campaign_counts x
    where %(campaign)s::text is null or x.campaign = %(campaign)s
    group by x.campaign
), k as (
    select n.campaign from n where n.sent > 0
    union
    select r.name from mail.reputation_guard r
    where r.scope = 'campaign' and (%(campaign)s::text is null or r.name = %(campaign)s)
)
select k.campaign,
       coalesce(n.sent, 0)                                            as sent,
       coalesce(n.delivered, 0)                                       as delivered,
       coalesce(n.hard_bounced, 0)                                    as hard_bounced,
       coalesce(n.soft_bounced, 0)                                    as soft_bounced,
       coalesce(n.complained, 0)                                      as complained,
       coalesce(n.failed_after_send, 0)                               as failed_after_send,
       coalesce(n.suppressed, 0)                                      as suppressed,
       coalesce(n.unique_opens, 0)                                    as unique_opens,
       coalesce(n.unique_clicks, 0)                                   as unique_clicks,
       coalesce(n.sent - n.with_outcome, 0)                           as no_outcome_yet,
       round(n.delivered::numeric / nullif(n.sent, 0), 6)             as delivered_rate,
       round(n.hard_bounced::numeric / nullif(n.sent, 0), 6)          as hard_bounce_rate,
       round(n.complained::numeric / nullif(n.sent, 0), 6)            as complaint_rate,
       round(n.unique_opens::numeric / nullif(n.sent, 0), 6)          as open_rate,
       round(n.unique_clicks::numeric / nullif(n.sent, 0), 6)         as click_rate,
       coalesce(g.state, 'ok')                                        as guard_state,
       g.reason                                                       as guard_reason,
       a.state                                                        as account_guard_state,
       a.reason                                                       as account_guard_reason,
       coalesce(n.holdout, 0)                                         as holdout
from k
left join n on n.campaign = k.campaign
left join mail.reputation_guard g on g.scope = 'campaign' and g.name = k.campaign
cross join lateral (
    select case when count(*) > 0 then 'tripped' else 'ok' end as state,
           string_agg(r.name || ': ' || r.reason, '; ' order by r.name) as reason
    from mail.reputation_guard r
    where r.scope = 'account' and r.state = 'tripped') as a
order by k.campaign

-- name: latest_days
-- The campaign page's day table: mail.campaign_daily's rows of %(campaign)s for its %(days)s latest days
-- (day, timezone, minted, sent, failed, rolled_back, cancelled, dead_lettered, unique_users, duplicate,
-- skipped, holdout; latest first), the same numbers as the view, without grouping the campaign's whole
-- history. Every event of a day on or after the cut-off instant `since` is read, so those days are exact:
-- `since` is 2 days before the start of the (3 * days - 2)-th latest UTC day with an event (a local day of
-- at most 25 hours touches at most 3 UTC days, so the latest days - 1 local days cover fewer UTC days than
-- that, and the latest `days` local days all start after `since`). Bounded reads: the latest UTC days of
-- minted_at and sent_at by skip scans of send_log_campaign_minted_idx / send_log_campaign_sent_idx (one
-- probe per day), rows minted or sent since the cut-off (the same ranges), and the campaign's failed and
-- closed (cancelled, duplicate, skipped) rows, whose event may come long after minting (their indexes).
with recursive minted_day (d) as (
    select date_trunc('day', max(l.minted_at) at time zone 'UTC')
    from mail.send_log l where l.campaign = %(campaign)s
    union all
    select (select date_trunc('day', max(l.minted_at) at time zone 'UTC') from mail.send_log l
            where l.campaign = %(campaign)s and l.minted_at < (m.d at time zone 'UTC'))
    from minted_day m
    where m.d is not null
), sent_day (d) as (
    select date_trunc('day', max(l.sent_at) at time zone 'UTC')
    from mail.send_log l where l.campaign = %(campaign)s and l.status = 'sent'
    union all
    select (select date_trunc('day', max(l.sent_at) at time zone 'UTC') from mail.send_log l
            where l.campaign = %(campaign)s and l.status = 'sent' and l.sent_at < (s.d at time zone 'UTC'))
    from sent_day s
    where s.d is not null
), failed as materialized (
    select l.campaign, l.kind, l.user_id, x.what, x.at
    from mail.send_log l
    cross join lateral (values
        ('failed', case when l.released_at is null then coalesce(l.dead_lettered_at, l.claimed_at, l.minted_at) end),
        ('rolled_back', l.released_at),
        ('dead_lettered', l.dead_lettered_at)
    ) as x (what, at)
    where l.campaign = %(campaign)s and l.status = 'failed' and x.at is not null
), closed as materialized (
    select l.campaign, l.kind, l.user_id, l.status as what,
           coalesce((select min(e.at) from mail.send_event e
                     where e.send_log_id = l.id and e.to_status = l.status), l.minted_at) as at
    from mail.send_log l
    where l.campaign = %(campaign)s and l.status in ('cancelled', 'duplicate', 'skipped')
), utc_days as (
    select d from (select m.d from minted_day m limit 3 * %(days)s) m0 where d is not null
    union
    select d from (select s.d from sent_day s limit 3 * %(days)s) s0 where d is not null
    union
    select date_trunc('day', f.at at time zone 'UTC') from failed f
    union
    select date_trunc('day', c.at at time zone 'UTC') from closed c
), cut as (
    select coalesce((select (u.d at time zone 'UTC') - interval '2 days' from utc_days u
                     order by u.d desc offset 3 * %(days)s - 3 limit 1), '-infinity'::timestamptz) as since
), a as (
    select l.campaign, l.kind, l.user_id, 'minted' as what, l.minted_at as at
    from mail.send_log l where l.campaign = %(campaign)s and l.minted_at >= (select since from cut)
    union all
    select l.campaign, l.kind, l.user_id, 'sent', l.sent_at
    from mail.send_log l
    where l.campaign = %(campaign)s and l.status = 'sent' and l.sent_at >= (select since from cut)
    union all
    select f.campaign, f.kind, f.user_id, f.what, f.at from failed f where f.at >= (select since from cut)
    union all
    select c.campaign, c.kind, c.user_id, c.what, c.at from closed c where c.at >= (select since from cut)
    union all
    select l.campaign, l.kind, l.user_id, 'holdout', l.minted_at
    from mail.send_log l
    where l.campaign = %(campaign)s and l.status = 'holdout' and l.minted_at >= (select since from cut)
)
select (a.at at time zone coalesce(c.timezone, 'UTC'))::date               as day,
       coalesce(c.timezone, 'UTC')                                         as timezone,
       count(*) filter (where a.what = 'minted')                           as minted,
       count(*) filter (where a.what = 'sent')                             as sent,
       count(*) filter (where a.what = 'failed')                           as failed,
       count(*) filter (where a.what = 'rolled_back')                      as rolled_back,
       count(*) filter (where a.what = 'cancelled')                        as cancelled,
       count(*) filter (where a.what = 'dead_lettered')                    as dead_lettered,
       count(distinct a.user_id)                                           as unique_users,
       count(*) filter (where a.what = 'duplicate')                        as duplicate,
       count(*) filter (where a.what = 'skipped')                          as skipped,
       count(*) filter (where a.what = 'holdout')                          as holdout
from a
left join mail.campaign c on a.kind = 'scheduled' and c.name = a.campaign
group by a.kind, coalesce(c.timezone, 'UTC'), (a.at at time zone coalesce(c.timezone, 'UTC'))::date
order by day desc
limit %(days)s
