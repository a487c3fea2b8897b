-- campaign_lift: the measured effect of each campaign that has a holdout group (docs/send_log.md,
-- "Holdout groups and lift").
--
-- Per campaign with at least one 'holdout' row: the treated group (its emails the provider accepted,
-- status 'sent') and the held-out group (status 'holdout': the users the campaign's holdout share kept
-- out, mail.in_holdout), each with its size, how many of its users converted, the conversion rate, and the
-- absolute lift (treated rate - holdout rate, in fractions 0..1).
--
-- Conversion (the demo product's): the user finished an assessment (app.assessments.finished_at) within
-- 7 days after the row's minted_at, i.e. in [minted_at, minted_at + 7 days). minted_at is the moment the
-- campaign decided about the user, for both groups alike (a sent email's sent_at follows it within
-- minutes for a lifecycle campaign; for a scheduled campaign both rows are created at provisioning).
-- Change the horizon in `params` only. Rows decided less than 7 days ago have not had their whole window:
-- both groups are equally young, so their rates are comparable, but both still grow (last_minted_at).
--
-- Why a file and not a migration: app.* is the product's schema, which a send-log database need not hold
-- (the send log may live in a database of its own), and a migration must run on every send-log database.
-- Run it where both schemas are visible (psql -f, or paste it); the demo loader installs it as the view
-- mail.campaign_lift (mailflow_dev.demo.loader), where the demo's app schema sits next to the send log.
-- Read path (never the whole send log): the campaigns and their holdout rows from send_log_holdout_idx, the
-- treated rows from each campaign's range of send_log_campaign_sent_idx, each user's assessments from
-- assessments_user_id_started_at_idx (app_schema.sql).
with params as (
    select interval '7 days' as horizon
), campaigns as (
    select distinct h.campaign from mail.send_log h where h.status = 'holdout'
), groups as (
    select k.campaign, l.kind, l.status, l.minted_at,
           exists (select 1 from app.assessments a
                   where a.user_id = l.user_id
                     and a.finished_at >= l.minted_at
                     and a.finished_at < l.minted_at + p.horizon) as converted
    from campaigns k
    cross join params p
    cross join lateral (
        select s.user_id, s.kind, s.status, s.minted_at from mail.send_log s
        where s.campaign = k.campaign and s.status = 'sent'
        union all
        select h.user_id, h.kind, h.status, h.minted_at from mail.send_log h
        where h.campaign = k.campaign and h.status = 'holdout'
    ) as l
), counts as (
    select g.campaign,
           min(g.kind)                                                    as kind,
           count(*) filter (where g.status = 'sent')                      as treated,
           count(*) filter (where g.status = 'sent' and g.converted)      as treated_converted,
           count(*) filter (where g.status = 'holdout')                   as holdout,
           count(*) filter (where g.status = 'holdout' and g.converted)   as holdout_converted,
           max(g.minted_at)                                               as last_minted_at
    from groups g
    group by g.campaign
)
select c.campaign,
       c.kind,
       c.treated,
       c.treated_converted,
       round(c.treated_converted::numeric / nullif(c.treated, 0), 6)      as treated_rate,
       c.holdout,
       c.holdout_converted,
       round(c.holdout_converted::numeric / nullif(c.holdout, 0), 6)      as holdout_rate,
       round(c.treated_converted::numeric / nullif(c.treated, 0)
             - c.holdout_converted::numeric / nullif(c.holdout, 0), 6)    as lift,
       (select p.horizon from params p)                                  as horizon,
       c.last_minted_at
from counts c
order by c.campaign
