-- migrate: no-transaction
-- 0031: the lift measures each user's window from the moment that user was (or, held out, would have been)
-- sent, and Q12 / Q15 of docs/send_log.md answer from rollups instead of reading a campaign's whole history.
--
-- * A holdout row's planned time. Scheduled provisioning gives a held-out recipient the slot of the plan it
--   would have had (the plan is made for every recipient, then the holdout group is marked): its
--   scheduled_at, never claimed or sent. A lifecycle holdout row is decided at minting, where its treated
--   neighbours are minted and sent: its minted_at (scheduled_at stays null). The lift anchors a treated user
--   on sent_at and a held-out user on coalesce(scheduled_at, minted_at) (docs/send_log.md, Q15).
--   send_log_holdout_slot_idx: a campaign's holdout rows in the order of that time (the lift reads its range).
-- * Backfill (mailflow.store.backfill.backfill_holdout_slots, batched, resumable; `mailflow migrate
--   --backfill` runs it again for rows an old worker provisioned during a rolling deploy): a scheduled holdout
--   row provisioned before 0031 has no slot. Its slot is recovered from the plan: the planned time of the
--   campaign's next recipient in provisioning order (user_id) that got one, i.e. the slot the held-out user
--   would have taken; the previous recipient's when it was the last; its minted_at (the provisioning
--   time) when the campaign has no planned row at all.
-- * Day counters (mailflow.store.backfill.install_outcome_day_counters runs
--   store/sql/steps/0031_outcome_day_counters.sql in one short transaction): per campaign and day of sending,
--   the sent emails and their outcomes, kept by statement-level triggers like 0028's counters and folded with
--   them. Seeded here, on the live send log, by their first fold (one count, about a minute at 20M rows;
--   writers keep writing: what commits after its snapshot keeps its delta); then mail.campaign_outcomes_daily
--   (Q12), and mail.campaign_outcomes through it, read them instead of every sent email of the campaign.
-- * mail.campaign_lift_day / mail.campaign_lift_fold: the lift's rollup of closed windows, per campaign, group
--   and day, filled by mail.fold_campaign_lift (store/sql/analytics/campaign_lift_fold.sql, installed where
--   the product's schema is visible: it defines the conversion); the lift query adds the rows after each
--   campaign's fold watermark. Empty until a fold ran: the query then reads every row, as before.
-- Run statement by statement outside a transaction (the index is built CONCURRENTLY); every statement is
-- idempotent, so an interrupted run starts again from the top.

create index concurrently if not exists send_log_holdout_slot_idx
    on mail.send_log (campaign, (coalesce(scheduled_at, minted_at))) include (user_id, kind) where status = 'holdout';

-- migrate: python backfill_holdout_slots

-- migrate: python install_outcome_day_counters

-- The day counters hold every sent email from here on: the first fold counts the send log once (one statement,
-- one snapshot: the counts as of it and the deltas it sees; a change committed after it keeps its delta for the
-- next fold), while the view below still counts the send log. About a minute at 20M rows (docs/performance.md).
select mail.fold_campaign_day_counters();

-- The same columns, in the same order and types, from the day counters (folded plus unfolded deltas): a filter
-- on campaign (and day) is a range of their primary key, grouped in its order; the timezone is the campaign's.
create or replace view mail.campaign_outcomes_daily as
select o.campaign,
       o.kind,
       coalesce(c.timezone, 'UTC')                            as timezone,
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
    select x.campaign,
           x.day,
           x.kind,
           coalesce(sum(x.n) filter (where x.key = 'sent'), 0)::bigint                      as sent,
           coalesce(sum(x.n) filter (where x.key = 'delivered'), 0)::bigint                 as delivered,
           coalesce(sum(x.n) filter (where x.key = 'hard_bounced'), 0)::bigint              as hard_bounced,
           coalesce(sum(x.n) filter (where x.key = 'soft_bounced'), 0)::bigint              as soft_bounced,
           coalesce(sum(x.n) filter (where x.key = 'complained'), 0)::bigint                as complained,
           coalesce(sum(x.n) filter (where x.key = 'failed_after_send'), 0)::bigint         as failed_after_send,
           coalesce(sum(x.n) filter (where x.key = 'suppressed'), 0)::bigint                as suppressed,
           coalesce(sum(x.n) filter (where x.key = 'unique_opens'), 0)::bigint              as unique_opens,
           coalesce(sum(x.n) filter (where x.key = 'unique_clicks'), 0)::bigint             as unique_clicks,
           (coalesce(sum(x.n) filter (where x.key = 'sent'), 0)
            - coalesce(sum(x.n) filter (where x.key = 'with_outcome'), 0))::bigint          as no_outcome_yet
    from (select d.campaign, d.day, d.kind, d.key, d.n from mail.campaign_day_counter d
          union all
          select d.campaign, d.day, d.kind, d.key, d.n from mail.campaign_day_counter_delta d) as x
    group by x.campaign, x.day, x.kind
    having coalesce(sum(x.n) filter (where x.key = 'sent'), 0) <> 0
) as o
left join mail.campaign c on o.kind = 'scheduled' and c.name = o.campaign;

comment on view mail.campaign_outcomes_daily is
    'Per campaign and local day of sending: the emails the provider accepted (status sent) and what it reported '
    'about them since (mail.delivery_status: webhooks and the poll). Each email counts once per outcome it had; '
    'rates are fractions 0..1 of sent. Day = local date of sent_at in the scheduled campaign''s timezone, UTC '
    'otherwise. Read from the day counters (mail.campaign_day_counter plus unfolded deltas): a campaign''s '
    'few hundred counter rows. Filter by campaign (and day). See docs/send_log.md.';

-- The lift's rollup: rows whose conversion window closed, counted by mail.fold_campaign_lift.
create table if not exists mail.campaign_lift_day (
    campaign  text     not null,
    horizon   interval not null,
    grp       text     not null check (grp in ('treated', 'holdout')),
    day       date     not null,
    users     bigint   not null,
    converted bigint   not null,
    primary key (campaign, horizon, grp, day)
);

create table if not exists mail.campaign_lift_fold (
    campaign  text        not null,
    horizon   interval    not null,
    kind      text        not null,
    through   timestamptz not null,
    folded_at timestamptz not null default now(),
    primary key (campaign, horizon)
);

comment on table mail.campaign_lift_day is
    'The lift''s closed windows (docs/send_log.md, Q15): per campaign, conversion horizon, group and UTC day of '
    'the window''s start, the users counted and how many converted. Written only by mail.fold_campaign_lift '
    '(store/sql/analytics/campaign_lift_fold.sql, which defines the conversion); rows after the campaign''s '
    'mail.campaign_lift_fold.through are counted by the lift query itself.';
comment on column mail.campaign_lift_day.campaign is 'Campaign name (one with a holdout group).';
comment on column mail.campaign_lift_day.horizon is 'The conversion window''s length (the lift query''s params.horizon).';
comment on column mail.campaign_lift_day.grp is
    'treated (status sent, window from sent_at) or holdout (status holdout, window from coalesce(scheduled_at, '
    'minted_at): the planned slot, or the minting of a lifecycle holdout row).';
comment on column mail.campaign_lift_day.day is 'UTC date on which these users'' windows started.';
comment on column mail.campaign_lift_day.users is 'Users of the group whose window started that day.';
comment on column mail.campaign_lift_day.converted is 'Of those, users who converted within the horizon.';
comment on table mail.campaign_lift_fold is
    'Per campaign and horizon: the lift''s fold watermark. Rows whose window started before through are in '
    'mail.campaign_lift_day; later ones are read live.';
comment on column mail.campaign_lift_fold.campaign is 'Campaign name.';
comment on column mail.campaign_lift_fold.horizon is 'The conversion window''s length.';
comment on column mail.campaign_lift_fold.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_lift_fold.through is
    'Windows starting before this instant are folded (at most now - horizon - a settling day when folded; for a '
    'scheduled campaign with rows left to send, or cancelled, also at most its latest send).';
comment on column mail.campaign_lift_fold.folded_at is 'When the campaign was last folded (timestamptz, UTC).';
comment on column mail.send_log.scheduled_at is
    'Scheduled rows: the planned send time (timestamptz, UTC), moved on resume or backoff; a holdout row keeps the '
    'slot its plan gave it (when it would have been sent, never sent). Null for lifecycle rows.';
