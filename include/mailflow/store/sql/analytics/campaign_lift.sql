-- campaign_lift: the measured effect of each campaign that has a holdout group (docs/send_log.md, Q15).
--
-- Per campaign with at least one 'holdout' row: the treated group (its emails the provider accepted, status
-- 'sent') and the held-out group (status 'holdout': the users the campaign's holdout share kept out,
-- mail.in_holdout), each with its size, how many of its users converted, the conversion rate, and the
-- absolute lift (treated rate - holdout rate, in fractions 0..1).
--
-- Each user's window starts at the moment that user was sent, or would have been:
-- * treated: sent_at, when the provider accepted the email;
-- * held out, scheduled campaign: scheduled_at, the slot of the plan the user would have been sent in
--   (provisioning plans every recipient, then marks the holdout group: both groups are spread over the same
--   days and weeks);
-- * held out, lifecycle campaign: minted_at, the moment the run decided about the user, with the users it
--   minted and sent in the same chunk (their sent_at follows within seconds).
-- Conversion (the demo product's): the user finished an assessment (app.assessments.finished_at) in
-- [start, start + 7 days). Change the horizon in `params` only (the rollup below is kept per horizon).
--
-- A held-out user of a scheduled campaign counts once the campaign's sending has passed their slot: while it
-- has rows to send (pending or sending), or once cancelled, the slot is at or before its latest send, so the
-- held-out users planned among the treated users that wait (a paused or held campaign, a canary not yet
-- released) wait with them, and a cancelled campaign never counts those planned after it stopped; once it
-- has nothing left to send, every slot that has passed. A window that started less than 7 days ago is still
-- open (open_windows): both groups' rates still grow, alike.
--
-- Closed windows come from the rollup mail.campaign_lift_day, folded by mail.fold_campaign_lift
-- (campaign_lift_fold.sql, the same conversion): per campaign, the rows whose window started before its
-- watermark (mail.campaign_lift_fold.through) are its rollup rows, the later ones are read here, so the cost
-- is the rows of the last horizon (plus a settling day) whatever the campaign's age. Without a fold (or
-- for another horizon) every row is read here: the same numbers, at the cost of the campaign's history.
--
-- Why a file and not a migration: app.* is the product's schema, which a send-log database need not hold
-- (the send log may live in a database of its own), and a migration must run on every send-log database.
-- Run it where both schemas are visible (psql -f, or paste it); the demo loader installs it as the view
-- mail.campaign_lift (mailflow_dev.demo.loader), where the demo's app schema sits next to the send log. A
-- filter on campaign (select ... from mail.campaign_lift where campaign = '...') reads that campaign only.
-- Read path (never the whole send log): the campaigns with a holdout group by a skip scan of
-- send_log_holdout_slot_idx (one probe per campaign), whether it has an open row (send_log_campaign_open_idx)
-- and its latest send (send_log_campaign_sent_idx), each campaign's rollup rows (its primary key range), its
-- treated rows since the watermark (a range of send_log_campaign_sent_idx), its held-out rows since the
-- watermark (a range of send_log_holdout_slot_idx), each user's assessments
-- (assessments_user_id_started_at_cover_idx, app_schema.sql: index-only).
with recursive params as (
    select interval '7 days' as horizon
), seen (campaign) as (
    (select h.campaign from mail.send_log h where h.status = 'holdout' order by h.campaign limit 1)
    union all
    select (select h.campaign from mail.send_log h where h.status = 'holdout' and h.campaign > s.campaign
            order by h.campaign limit 1)
    from seen s
    where s.campaign is not null
), campaigns as (
    select s.campaign,
           k.kind,
           coalesce(f.through, '-infinity'::timestamptz)                      as through,
           case when k.kind = 'lifecycle' then now()
                when (select o.scheduled_at from mail.send_log o
                      where o.campaign = s.campaign and o.status in ('pending', 'sending')
                      order by o.campaign, o.scheduled_at limit 1) is not null
                  or exists (select 1 from mail.campaign m where m.name = s.campaign and m.status = 'cancelled')
                then (select max(t.sent_at) from mail.send_log t
                      where t.campaign = s.campaign and t.status = 'sent')
                else now() end                                                 as cut
    from seen s
    cross join params p
    cross join lateral (select h.kind from mail.send_log h
                        where h.campaign = s.campaign and h.status = 'holdout' limit 1) as k
    left join mail.campaign_lift_fold f on f.campaign = s.campaign and f.horizon = p.horizon
    where s.campaign is not null
)
select c.campaign,
       c.kind,
       n.treated,
       n.treated_converted,
       round(n.treated_converted::numeric / nullif(n.treated, 0), 6)           as treated_rate,
       n.holdout,
       n.holdout_converted,
       round(n.holdout_converted::numeric / nullif(n.holdout, 0), 6)           as holdout_rate,
       round(n.treated_converted::numeric / nullif(n.treated, 0)
             - n.holdout_converted::numeric / nullif(n.holdout, 0), 6)         as lift,
       p.horizon,
       n.open_windows
from campaigns c
cross join params p
cross join lateral (
    select coalesce(sum(x.users) filter (where x.grp = 'treated'), 0)::bigint     as treated,
           coalesce(sum(x.converted) filter (where x.grp = 'treated'), 0)::bigint as treated_converted,
           coalesce(sum(x.users) filter (where x.grp = 'holdout'), 0)::bigint     as holdout,
           coalesce(sum(x.converted) filter (where x.grp = 'holdout'), 0)::bigint as holdout_converted,
           coalesce(sum(x.open_windows), 0)::bigint                               as open_windows
    from (
        -- the rows whose window started since the campaign's fold watermark, read here
        select g.grp, count(*) as users, count(*) filter (where g.converted) as converted,
               count(*) filter (where g.start_at > now() - p.horizon) as open_windows
        from (
            select l.grp, l.start_at,
                   exists (select 1 from app.assessments a
                           where a.user_id = l.user_id
                             and a.started_at < l.start_at + p.horizon
                             and a.finished_at >= l.start_at
                             and a.finished_at < l.start_at + p.horizon) as converted
            from (select 'treated' as grp, t.user_id, t.sent_at as start_at from mail.send_log t
                  where t.campaign = c.campaign and t.status = 'sent' and t.sent_at >= c.through and t.sent_at <= now()
                  union all
                  select 'holdout', h.user_id, coalesce(h.scheduled_at, h.minted_at) from mail.send_log h
                  where h.campaign = c.campaign and h.status = 'holdout'
                    and coalesce(h.scheduled_at, h.minted_at) >= c.through
                    and coalesce(h.scheduled_at, h.minted_at) <= c.cut) as l
        ) as g
        group by g.grp
        union all
        -- the closed windows before it, folded
        select d.grp, d.users, d.converted, 0
        from mail.campaign_lift_day d
        where d.campaign = c.campaign and d.horizon = p.horizon and c.through > '-infinity'::timestamptz
    ) as x
) as n
order by c.campaign
