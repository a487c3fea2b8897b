-- migrate: no-transaction
-- 0025: holdout groups, so an analyst can measure a campaign's effect (docs/model.md, "Holdout groups").
--
-- * status 'holdout': a terminal state. A campaign with a holdout share s records the users of its audience
--   whose mail.holdout_fraction(campaign, user_id) is below s as a 'holdout' row where it would have minted
--   (lifecycle) or planned (scheduled provisioning) their email: never claimed, never sent, never
--   reconciled, no scheduled_at. The row holds the live (user_id, campaign) key, so a rerun or a backfill
--   does not select the user again; it is not a contact (the cooldown and the caps read pending, sending
--   and sent rows only).
-- * mail.holdout_fraction / mail.in_holdout: membership as a pure function of (campaign, user_id), the same
--   as mailflow.model.holdout in Python (tests hold the two against each other).
-- * mail.campaign.holdout_share: the scheduled campaign's share (lifecycle campaigns declare theirs in
--   lifecycle.toml).
-- * send_log_holdout_idx: a campaign's holdout rows as one index range (the progress counts, the lift).
-- * mail.campaign_daily, mail.campaign_progress and mail.campaign_outcomes get a holdout column (last, so
--   CREATE OR REPLACE VIEW keeps the others); holdout rows count in campaign_progress.total and done
--   (mailflow.model.tally: every row is in exactly one state column).
-- The comparison itself (mail.campaign_lift) joins the product's schema (app.assessments), which a
-- send-log database need not hold: it is a documented query (store/sql/analytics/campaign_lift.sql) that
-- the demo loader also installs as a view (docs/send_log.md, "Holdout groups and lift").
-- Run statement by statement outside a transaction (the index is built CONCURRENTLY); every statement is
-- idempotent, so an interrupted run starts again from the top.

-- The status check gains 'holdout', keeping whatever states it already allows (one ALTER TABLE: the check is
-- never absent; NOT VALID: no scan under the lock). PL/pgSQL cannot run here (no dollar-quoted bodies outside a
-- transaction): mailflow.store.backfill.allow_holdout_status.
-- migrate: python allow_holdout_status

-- The user's uniform draw for the campaign in [0, 1): the first 52 bits of sha256(utf8(campaign || ':' ||
-- user_id)) / 2^52 (exact in float8, so Python's mailflow.model.holdout computes the same number).
-- IMMUTABLE although convert_to is only STABLE: converting to UTF8 depends on the database's encoding,
-- which never changes for a database, so the result depends on the arguments alone.
create or replace function mail.holdout_fraction(campaign text, user_id bigint) returns float8
    language sql immutable strict parallel safe
    return ('x' || substr(encode(sha256(convert_to(campaign || ':' || user_id::text, 'UTF8')), 'hex'), 1, 13))
               ::bit(52)::bigint::float8 / 4503599627370496::float8;

create or replace function mail.in_holdout(campaign text, user_id bigint, share float8) returns boolean
    language sql immutable strict parallel safe
    return share > 0 and mail.holdout_fraction(campaign, user_id) < share;

comment on function mail.holdout_fraction(text, bigint) is
    'A user''s uniform draw for a campaign in [0, 1): first 52 bits of sha256(campaign:user_id) / 2^52 (mailflow.model.holdout).';
comment on function mail.in_holdout(text, bigint, float8) is
    'Whether the user is in the campaign''s holdout group for a share (holdout_fraction < share; share 0: nobody).';

alter table mail.campaign add column if not exists holdout_share float8 not null default 0;
alter table mail.campaign drop constraint if exists campaign_holdout_share_range;
alter table mail.campaign add constraint campaign_holdout_share_range check (holdout_share >= 0 and holdout_share < 1);
comment on column mail.campaign.holdout_share is
    'Share [0, 1) of the recipients held out as a control group: a send-log row with status holdout (no slot, '
    'never sent) for each recipient with mail.in_holdout(name, user_id, holdout_share); 0: nobody.';

create index concurrently if not exists send_log_holdout_idx on mail.send_log (campaign, minted_at)
    include (user_id, kind) where status = 'holdout';

comment on column mail.send_log.status is
    'pending (planned), sending (claimed, in flight), sent, failed (rejected, invalid address, rolled back '
    'or given up), cancelled, skipped (held back by the contact policy), duplicate (another user got '
    'this campaign at the same normalised address; error names them) or holdout (in the campaign''s '
    'holdout group: recorded, never sent, not a contact).';

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
       count(*) filter (where a.what = 'skipped')                          as skipped,
       count(*) filter (where a.what = 'holdout')                          as holdout
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
    union all
    select l.campaign, l.kind, l.user_id, 'holdout', l.minted_at
    from mail.send_log l
    where l.status = 'holdout'
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
       o.pending + o.sending + st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped + ho.holdout
                                                                              as total,
       o.pending, o.sending, st.sent, fl.failed, cn.cancelled, fl.rolled_back, fl.dead_lettered,
       st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped + ho.holdout
                                                                              as done,
       coalesce(round(100.0 * (st.sent + fl.failed + cn.cancelled + cn.duplicate + cn.skipped + ho.holdout)
                      / nullif(o.pending + o.sending + st.sent + fl.failed + cn.cancelled + cn.duplicate
                               + cn.skipped + ho.holdout, 0), 1), 0.0)
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
       fl.invalid,
       ho.holdout
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
    select count(*) as holdout
    from mail.send_log l where l.campaign = k.campaign and l.status = 'holdout') as ho
cross join lateral (
    select st.sent_last_5m * 60.0 / greatest(extract(epoch from now() - st.window_first_sent), 30) as per_min
) as r
left join mail.campaign c on c.name = k.campaign;

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
       a.reason                                                       as account_guard_reason,
       h.holdout
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
    where r.scope = 'account' and r.state = 'tripped') as a
cross join lateral (
    select count(*) as holdout
    from mail.send_log l where l.campaign = k.campaign and l.status = 'holdout') as h;

comment on column mail.campaign_daily.holdout is 'Holdout rows recorded that day (by minted_at): users held out of the campaign.';
comment on column mail.campaign_progress.total is
    'Rows of the campaign in every state (pending + sending + sent + failed + cancelled + duplicate + skipped '
    '+ holdout), excluding rolled-back attempts.';
comment on column mail.campaign_progress.done is
    'sent + failed + cancelled + duplicate + skipped + holdout (terminal rows).';
comment on column mail.campaign_progress.holdout is
    'Rows in the campaign''s holdout group (status holdout: never sent, not a contact).';
comment on column mail.campaign_outcomes.holdout is
    'Rows in the campaign''s holdout group (status holdout), the control group of mail.campaign_lift.';
