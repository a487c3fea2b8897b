-- name: seeded
-- Whether the counters hold the whole send log (migration 0028: seeded by the first fold, or at once on an
-- empty send log); until then readers use the views. One row.
select seeded_at is not null from mail.campaign_counter_state

-- name: fold
-- Fold the pending changes into mail.campaign_counter (the first call seeds it with a full count). Returns
-- the delta rows folded, or null when another fold is running (it folds the same rows: nothing is lost).
select mail.fold_campaign_counters()

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
