-- name: campaign_insert
-- Create a campaign (status draft); every value is bound. Returns its id.
insert into mail.campaign (name, timezone, emails_per_day, weekdays, windows, holidays, start_at, template, subject,
                           from_address, reply_to, recipients_sql, recipients_table, marketing, on_policy,
                           canary_share, canary_min_outcome_share, canary_max_wait, holdout_share)
values (%(name)s, %(timezone)s, %(emails_per_day)s, %(weekdays)s, %(windows)s, %(holidays)s, coalesce(%(start_at)s, now()),
        %(template)s, %(subject)s, %(from_address)s, %(reply_to)s, %(recipients_sql)s, %(recipients_table)s,
        %(marketing)s, %(on_policy)s, %(canary_share)s, %(canary_min_outcome_share)s, %(canary_max_wait)s,
        %(holdout_share)s)
returning id

-- name: campaign_update_definition
-- Replace the definition of a draft campaign (the same values as campaign_insert; the name stays).
-- Only a draft: the status is part of the condition, so a campaign provisioned meanwhile is not
-- changed (no row comes back).
update mail.campaign
set timezone = %(timezone)s, emails_per_day = %(emails_per_day)s, weekdays = %(weekdays)s, windows = %(windows)s,
    holidays = %(holidays)s, start_at = coalesce(%(start_at)s, now()), template = %(template)s,
    subject = %(subject)s, from_address = %(from_address)s, reply_to = %(reply_to)s,
    recipients_sql = %(recipients_sql)s, recipients_table = %(recipients_table)s, marketing = %(marketing)s,
    on_policy = %(on_policy)s, canary_share = %(canary_share)s,
    canary_min_outcome_share = %(canary_min_outcome_share)s, canary_max_wait = %(canary_max_wait)s,
    holdout_share = %(holdout_share)s, updated_at = now()
where id = %(id)s and status = 'draft'
returning id

-- name: campaign_recipients_clear
-- Drop a campaign's uploaded recipient list (a draft's definition is replaced with another list).
delete from mail.campaign_recipient where campaign_id = %(id)s

-- name: lifecycle_name_used
-- Whether the send log has lifecycle rows under this campaign name (send_log_campaign_minted_idx).
select exists (select 1 from mail.send_log where campaign = %(name)s and kind = 'lifecycle')

-- name: recipients_probe
-- A recipient source's columns without reading a row: plans and runs the query with limit 0, so a
-- query that fails (syntax, a missing table or column) fails here.
select *
from (
{source}
) as r
limit 0

-- name: campaign_lock
-- One campaign row, locked for the rest of the transaction: provisioning chunks, status changes
-- and re-planning of one campaign are serialised on it (two provisioning runs never interleave).
select * from mail.campaign where id = %(id)s for update

-- name: campaign_by_id
-- One campaign row (no lock).
select * from mail.campaign where id = %(id)s

-- name: campaign_id_by_name
-- Resolve a campaign name to its id.
select id from mail.campaign where name = %(name)s

-- name: campaigns_by_name
-- The campaign rows the dispatcher renders for (no lock).
select * from mail.campaign where name = any(%(names)s::text[])

-- name: campaign_event
-- Append one campaign event (a status change or a provisioning / re-planning milestone).
insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
values (%(id)s, %(from_status)s, %(to_status)s, %(detail)s, %(actor)s)

-- name: campaign_set_status
-- Guarded status change: only from the expected current status (the caller holds the row lock).
update mail.campaign set status = %(to_status)s, updated_at = now()
where id = %(id)s and status = %(from_status)s
returning id

-- name: recipients_page
-- The next page of a campaign's recipients in user_id order (keyset on the checkpoint). The
-- source is the campaign's version-controlled SQL file or its uploaded list table (composed as
-- SQL / an identifier, never from input); the whole row comes back as one JSON object.
select to_jsonb(r) as rec
from (
{source}
) as r
where r.user_id > %(after)s
order by r.user_id
limit %(limit)s

-- name: recipients_count
-- How many recipients remain after the checkpoint (dry runs).
select count(*)
from (
{source}
) as r
where r.user_id > %(after)s

-- name: provision_rows
-- One chunk of rows (kind 'scheduled') with their recipient snapshot: 'pending' with the planned
-- time, or 'holdout' (the recipient is in the campaign's holdout group: the slot it would have been sent in,
-- never claimed).
-- ON CONFLICT DO NOTHING on the live unique key (user_id, campaign): a row that exists is kept as
-- it is. The creation event (null -> status) is appended in the same statement.
with created as (
    insert into mail.send_log (user_id, campaign, kind, email, email_key, context, status, scheduled_at,
                               dag_id, run_id, task_id)
    select p.user_id, %(campaign)s, 'scheduled', p.email, p.email_key, p.context, coalesce(p.status, 'pending'),
           p.scheduled_at, %(dag_id)s, %(run_id)s, %(task_id)s
    from jsonb_to_recordset(%(page)s::jsonb)
         as p(user_id bigint, email text, email_key text, context jsonb, scheduled_at timestamptz, status text)
    order by p.user_id
    on conflict (user_id, campaign) where released_at is null do nothing
    returning id, status
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, dag_id, run_id, task_id)
    select id, null, status, 0, %(dag_id)s, %(run_id)s, %(task_id)s from created
)
select count(*), count(*) filter (where status = 'holdout') from created

-- name: advance_checkpoint
-- The provisioning checkpoint, in the same transaction as the chunk it covers.
update mail.campaign
set provisioned_count = provisioned_count + %(created)s,
    provision_cursor = %(cursor)s,
    planned_through = %(planned_through)s,
    plan_start = %(plan_start)s,
    updated_at = now()
where id = %(id)s

-- name: mark_provisioned
-- The recipient list is exhausted: provisioning is complete (until new recipients appear). A
-- campaign with a canary share fixes its canary here, once: the first ceil(share * rows) of its
-- rows in plan order (id order: provisioning creates them in plan order); canary_last_id is the
-- last of them. Holdout rows are never sent: neither counted nor part of the canary. Read through
-- send_log_campaign_user_uq (campaign, user_id), once per campaign.
update mail.campaign c
set provisioned_at = coalesce(c.provisioned_at, now()), plan_start = coalesce(c.plan_start, %(plan_start)s),
    canary_last_id = case when c.canary_share is null or c.canary_last_id is not null then c.canary_last_id
                          else (select max(k.id) from (
                                    select l.id from mail.send_log l
                                    where l.campaign = c.name and l.kind = 'scheduled' and l.released_at is null
                                      and l.status <> 'holdout'
                                    order by l.id
                                    limit (select ceil(c.canary_share * count(*))::bigint from mail.send_log n
                                           where n.campaign = c.name and n.kind = 'scheduled'
                                             and n.released_at is null and n.status <> 'holdout')) k) end,
    updated_at = now()
where c.id = %(id)s

-- name: cancel_suppressed_due
-- Due pending rows of active campaigns whose user or address is suppressed (for all mail or this
-- campaign) are cancelled before anything is claimed; rows another dispatcher holds are skipped.
-- Only the head of the due queue is checked: the first 1,000 due rows (ten full batches) in
-- scheduled_at order, read through send_log_pending_due_idx with a LIMIT, so a claim costs the
-- same at 1,000 or 1,000,000 due rows (probing the whole backlog on every claim grew with it).
-- Complete all the same: pick_due never takes a suppressed row (its own NOT EXISTS) and picks in
-- the same order, so every suppressed row reaches the head, and is cancelled there, before the
-- rows after it are sent; a head made only of suppressed rows is cancelled 1,000 per claim.
-- The locked id list is a MATERIALIZED CTE: evaluated once (an IN-subquery with FOR UPDATE can be
-- rescanned per outer row, and a rescan skips the rows this statement already changed).
-- The address is judged here only for rows that keep their snapshot (the uploaded list: recipients_sql
-- null and recipients_table mail.campaign_recipient, claiming.UPLOADED_LIST). Every other row gets its
-- user's current address at claim time, and the claim's guard checks the suppression of THAT address
-- (a user whose old address bounced and who gave a new one is sent to the new one).
with head as materialized (
    select d.id, d.user_id, case when c.recipients_sql is null and c.recipients_table = 'mail.campaign_recipient'
                                 then d.email_key end as email_key, d.campaign
    from mail.send_log d
    join mail.campaign c on c.name = d.campaign and c.status = 'scheduled'
    where d.status = 'pending' and d.kind = 'scheduled' and d.scheduled_at <= now()
    order by d.scheduled_at
    limit 1000
), hit as materialized (
    select d.id
    from mail.send_log d
    where d.id in (select h.id from head h
                   where exists (select 1 from mail.suppression s
                                 where s.user_id = h.user_id and s.scope in ('all', h.campaign))
                      or exists (select 1 from mail.suppression s
                                 where s.email_key = h.email_key and s.scope in ('all', h.campaign)))
      and d.status = 'pending'
    for update of d skip locked
), gone as (
    update mail.send_log l
    set status = 'cancelled', error = 'suppressed before sending'
    where l.id in (select id from hit) and l.status = 'pending'
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'pending', 'cancelled', attempts, 'suppressed before sending', %(dag_id)s, %(run_id)s, %(task_id)s
from gone
returning send_log_id

-- name: due_wait
-- Seconds (database clock) until the dispatcher should claim: when the earliest pending row of an
-- active campaign has waited coalesce_seconds, or as soon as a full batch is due, whichever is
-- first. <= 0: claim now; null: nothing pending in any active campaign. Rows pick_due would not
-- take are left out the same way (held behind a canary, or the reputation guard tripped for the
-- campaign or the account), so a held row never makes the dispatcher spin.
-- Read head first, per active campaign: its first `batch` pending rows in scheduled_at order, one
-- ordered range of send_log_campaign_open_idx (campaign, scheduled_at) each, then the first `batch`
-- of those (the first `batch` of the union of every campaign's first `batch` is the first `batch`
-- overall). A call costs the same whatever the campaigns' backlogs (a join of the campaigns to all
-- their pending rows, then a sort, read every planned row of a big campaign on every call).
with p as (
    select x.scheduled_at
    from mail.campaign c
    cross join lateral (
        select d.scheduled_at
        from mail.send_log d
        where d.campaign = c.name and d.status = 'pending' and d.kind = 'scheduled'
          and (c.canary_share is null or c.canary_released_at is not null or d.id <= c.canary_last_id)
        order by d.scheduled_at
        limit %(batch)s
    ) as x
    where c.status = 'scheduled'
      and not exists (select 1 from mail.reputation_guard g
                      where (g.state = 'tripped' or g.waiting) and g.scope = 'campaign' and g.name = c.name)
      and not exists (select 1 from mail.reputation_guard g where (g.state = 'tripped' or g.waiting) and g.scope = 'account')
    order by x.scheduled_at
    limit %(batch)s
)
select extract(epoch from least(min(scheduled_at) + make_interval(secs => %(coalesce)s),
                                case when count(*) >= %(batch)s then max(scheduled_at) end) - now())::float8
from p

-- name: pick_due
-- Lock up to `limit` due rows of ONE active campaign (the one with the earliest due row nobody else
-- holds), FOR UPDATE SKIP LOCKED: two dispatchers never take the same row and never wait on each
-- other. Both selects are MATERIALIZED CTEs, evaluated exactly once. Suppressed rows are never
-- picked (see cancel_suppressed_due). The caller then takes the contact guard for the rows' users,
-- re-checks the policy and the addresses, and claims (claim_rows), defers or skips each row, in
-- the same transaction. The database enforces two holds here, whatever the caller does: a campaign
-- the reputation guard tripped (or any campaign while the account is tripped) is never picked, and
-- a campaign with a canary that is not released yet gives only its canary rows (id <= canary_last_id;
-- none until provisioning fixed the canary). The picked campaign's row is locked too (FOR NO KEY
-- UPDATE, SKIP LOCKED, before the send-log row: a campaign another claim holds is passed over without
-- locking any of its rows): claims of one campaign are serialised, so the caller's per-day cap
-- (day_sends) counts every email claimed before it, whatever the number of dispatchers. NO KEY UPDATE
-- does not block the campaign events' foreign-key checks. Suppression of the row's address is checked here only
-- for rows that keep their snapshot address (the uploaded list, as in cancel_suppressed_due); the
-- others get their user's current address in the claim, whose guard checks that address.
with pick as materialized (
    select d.campaign,
           case when c.canary_share is not null and c.canary_released_at is null
                then coalesce(c.canary_last_id, 0) end as canary_last_id,
           c.recipients_sql is null and c.recipients_table = 'mail.campaign_recipient' as snapshot_only
    from mail.send_log d
    join mail.campaign c on c.name = d.campaign and c.status = 'scheduled'
    where d.status = 'pending' and d.kind = 'scheduled' and d.scheduled_at <= now()
      and (c.canary_share is null or c.canary_released_at is not null or d.id <= c.canary_last_id)
      and not exists (select 1 from mail.reputation_guard g
                      where (g.state = 'tripped' or g.waiting) and g.scope = 'campaign' and g.name = c.name)
      and not exists (select 1 from mail.reputation_guard g where (g.state = 'tripped' or g.waiting) and g.scope = 'account')
      and not exists (select 1 from mail.suppression s
                      where s.user_id = d.user_id and s.scope in ('all', d.campaign))
      and not (c.recipients_sql is null and c.recipients_table = 'mail.campaign_recipient'
               and exists (select 1 from mail.suppression s
                           where s.email_key = d.email_key and s.scope in ('all', d.campaign)))
    order by d.scheduled_at, d.id
    limit 1
    for no key update of c skip locked
    for update of d skip locked
), due as materialized (
    select d.id, d.user_id, d.email, d.context, d.campaign, d.attempts, d.scheduled_at
    from mail.send_log d
    where d.campaign = (select campaign from pick)
      and d.status = 'pending' and d.kind = 'scheduled' and d.scheduled_at <= now()
      and ((select canary_last_id from pick) is null or d.id <= (select canary_last_id from pick))
      and not exists (select 1 from mail.suppression s
                      where s.user_id = d.user_id and s.scope in ('all', d.campaign))
      and not ((select snapshot_only from pick)
               and exists (select 1 from mail.suppression s
                           where s.email_key = d.email_key and s.scope in ('all', d.campaign)))
    order by d.scheduled_at, d.id
    limit %(limit)s
    for update skip locked
)
select id, user_id, email, context, campaign, attempts, scheduled_at from due order by scheduled_at, id

-- name: day_sends
-- A campaign's emails sent or in flight on one plan day [start, end): sent by sent_at (a range of
-- send_log_campaign_sent_id_idx) plus sending by claimed_at (a range of send_log_open_idx: only rows
-- in flight). What the dispatcher's per-day cap counts at claim time; the caller holds the campaign's
-- row lock (pick_due), so no other claim of the campaign is uncommitted meanwhile.
select (select count(*) from mail.send_log
        where campaign = %(campaign)s and status = 'sent' and sent_at >= %(start)s and sent_at < %(end)s)
     + (select count(*) from mail.send_log
        where status = 'sending' and claimed_at >= %(start)s and claimed_at < %(end)s
          and campaign = %(campaign)s)

-- name: due_count
-- How many of a campaign's rows are due now and claimable (pick_due's holds: a canary not released
-- gives only its rows), counted up to `limit` (one bounded range of send_log_campaign_open_idx).
select count(*)
from (select 1
      from mail.send_log d
      join mail.campaign c on c.name = d.campaign
      where d.campaign = %(campaign)s and d.status = 'pending' and d.kind = 'scheduled' and d.scheduled_at <= now()
        and (c.canary_share is null or c.canary_released_at is not null or d.id <= c.canary_last_id)
      limit %(limit)s) as x

-- name: claim_rows
-- Claim picked rows (locked by pick_due, passed by the contact guard): pending -> sending,
-- claimed_at, attempts + 1, the address as normalised for sending, and the event, in one statement.
-- `l.status = 'pending'` re-checks the state.
with claimed as (
    update mail.send_log l
    set status = 'sending', claimed_at = now(), attempts = l.attempts + 1, email = r.email,
        email_key = coalesce(l.email_key, r.email_key),
        dag_id = %(dag_id)s, run_id = %(run_id)s, task_id = %(task_id)s
    from unnest(%(ids)s::bigint[], %(emails)s::text[], %(keys)s::text[]) as r(id, email, email_key)
    where l.id = r.id and l.status = 'pending'
    returning l.id, l.user_id, l.email, l.context, l.campaign, l.attempts, l.scheduled_at
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, dag_id, run_id, task_id)
    select id, 'pending', 'sending', attempts, %(dag_id)s, %(run_id)s, %(task_id)s from claimed
)
select id, user_id, email, context, campaign, attempts from claimed order by scheduled_at, id

-- name: current_addresses
-- The claimed users' addresses now, from the campaign's recipient source (its recipients SQL file
-- or table, composed as SQL / an identifier, never from input), restricted to the claimed user_ids:
-- one set-based statement per claim. The restriction is pushed into the source (a plain select of
-- app.users reads its primary key per user). A user the source returns twice gets one address
-- (the smallest, so the choice is stable); an address that is null or blank is returned as null.
select distinct on (r.user_id) r.user_id, nullif(btrim(r.email::text), '') as email
from (
{source}
) as r
where r.user_id = any(%(user_ids)s::bigint[])
order by r.user_id, nullif(btrim(r.email::text), '') nulls last

-- name: readdress_rows
-- Give picked rows (locked by pick_due) the address the recipient source has now, with its mailbox
-- key, and record each change in mail.address_change (old and new), in one statement of the claim's
-- transaction. Only a row never attempted is re-addressed: still pending, kind scheduled, without an
-- idempotency key (a row with a key has stored bytes: a retry sends the same bytes to the same
-- address). Returns the ids changed.
with old as materialized (
    select l.id, l.user_id, l.campaign, l.email, l.email_key
    from mail.send_log l
    where l.id = any(%(ids)s::bigint[]) and l.status = 'pending' and l.kind = 'scheduled'
      and l.idempotency_key is null
), changed as (
    update mail.send_log l
    set email = r.email, email_key = r.email_key
    from unnest(%(ids)s::bigint[], %(emails)s::text[], %(keys)s::text[]) as r(id, email, email_key)
    join old o on o.id = r.id
    where l.id = r.id and l.email is distinct from r.email
    returning l.id, o.user_id, o.campaign, o.email as old_email, o.email_key as old_email_key,
              r.email as new_email, r.email_key as new_email_key
)
insert into mail.address_change (send_log_id, user_id, campaign, old_email, old_email_key, new_email, new_email_key,
                                 dag_id, run_id, task_id)
select id, user_id, campaign, old_email, old_email_key, new_email, new_email_key, %(dag_id)s, %(run_id)s, %(task_id)s
from changed
returning send_log_id

-- name: decide_rows
-- Picked rows decided without a request, each with its reason (recorded on the row and its event):
-- 'skipped' (the contact policy held it back and the campaign skips), 'failed' (invalid address:
-- the validator's reason), 'cancelled' (the normalised address is suppressed), or 'pending' again
-- with a new scheduled_at (deferred by the contact policy to the first planned slot after the
-- window). Guarded on 'pending'.
with changed as (
    update mail.send_log l
    set status = r.status, error = r.reason, scheduled_at = coalesce(r.at, l.scheduled_at)
    from unnest(%(ids)s::bigint[], %(statuses)s::text[], %(reasons)s::text[], %(ats)s::timestamptz[])
         as r(id, status, reason, at)
    where l.id = r.id and l.status = 'pending'
    returning l.id, l.attempts, r.status, r.reason
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'pending', status, attempts, reason, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: day_counts
-- A campaign's emails per plan day from `since` on (planned, in flight or sent; by planned, sent
-- or claim time): where a deferred email still fits the daily count. The plan day is the local date
-- of the local time minus `day_start` (planner.plan_day: a window crossing midnight counts towards
-- the date it opens on).
select ((case when status = 'pending' then scheduled_at else coalesce(sent_at, claimed_at) end
         at time zone %(tz)s) - %(day_start)s::interval)::date as day, count(*)
from mail.send_log
where campaign = %(campaign)s and status in ('pending', 'sending', 'sent')
  and case when status = 'pending' then scheduled_at else coalesce(sent_at, claimed_at) end >= %(since)s
group by 1

-- name: cancel_pending
-- Cancel: every pending row of the campaign -> cancelled (rows already sending finish as they
-- are; sent/failed rows are terminal and untouched), with one event per row.
with gone as (
    update mail.send_log l
    set status = 'cancelled', error = %(reason)s
    where l.campaign = %(campaign)s and l.status = 'pending'
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'pending', 'cancelled', attempts, %(reason)s, %(dag_id)s, %(run_id)s, %(task_id)s from gone
returning send_log_id

-- name: pending_in_order
-- A campaign's pending rows in plan order, locked (re-planning at resume).
select id, scheduled_at
from mail.send_log
where campaign = %(campaign)s and status = 'pending'
order by scheduled_at, id
for update

-- name: replan_rows
-- Give pending rows their re-planned times (guarded: only rows still pending).
update mail.send_log l
set scheduled_at = r.at
from unnest(%(ids)s::bigint[], %(times)s::timestamptz[]) as r(id, at)
where l.id = r.id and l.status = 'pending'

-- name: set_plan
-- The campaign's plan after re-planning: anchor, slots skipped on its first day, last slot used.
update mail.campaign
set plan_start = %(plan_start)s, plan_skip = %(plan_skip)s, planned_through = %(planned_through)s,
    updated_at = now()
where id = %(id)s

-- name: sent_between
-- A campaign's emails on one local day [start, end): sent or in flight (by sent/claim time) and,
-- with include_pending, pending ones planned that day (the per-day cap when a plan is re-anchored).
select count(*)
from mail.send_log
where campaign = %(campaign)s
  and (status in ('sent', 'sending') or (%(include_pending)s and status = 'pending'))
  and case when status = 'pending' then scheduled_at else coalesce(sent_at, claimed_at) end >= %(start)s
  and case when status = 'pending' then scheduled_at else coalesce(sent_at, claimed_at) end < %(end)s

-- name: complete_finished
-- A scheduled campaign whose list is fully provisioned and which has no pending or sending row
-- left is completed (optionally only campaign `id`); the event is appended in the same statement.
with done as (
    update mail.campaign c
    set status = 'completed', updated_at = now()
    where c.status = 'scheduled' and c.provisioned_at is not null
      and (%(id)s::bigint is null or c.id = %(id)s::bigint)
      and not exists (select 1 from mail.send_log l
                      where l.campaign = c.name and l.status in ('pending', 'sending'))
    returning c.id, c.name
), ev as (
    insert into mail.campaign_event (campaign_id, from_status, to_status, actor)
    select id, 'scheduled', 'completed', %(actor)s from done
)
select id, name from done

-- name: campaign_counts
-- Rows of one campaign by status, plus the next due time and send lateness percentiles (seconds).
select count(*) filter (where status = 'pending') as pending,
       count(*) filter (where status = 'sending') as sending,
       count(*) filter (where status = 'sent') as sent,
       count(*) filter (where status = 'failed') as failed,
       count(*) filter (where status = 'cancelled') as cancelled,
       count(*) filter (where status = 'holdout') as holdout,
       count(*) filter (where dead_lettered_at is not null) as dead_lettered,
       min(scheduled_at) filter (where status = 'pending') as next_due,
       max(sent_at) as last_sent,
       percentile_cont(0.5) within group (order by extract(epoch from sent_at - scheduled_at))
           filter (where status = 'sent') as lateness_p50_s,
       percentile_cont(0.99) within group (order by extract(epoch from sent_at - scheduled_at))
           filter (where status = 'sent') as lateness_p99_s
from mail.send_log
where campaign = %(campaign)s and kind = 'scheduled'

-- name: pause_reason
-- Why a campaign was last paused, if the pause carried a reason (the dispatcher pauses a campaign
-- that is itself at fault: a refused field, a claim that raised).
select detail->>'reason' from mail.campaign_event
where campaign_id = %(id)s and to_status = 'paused'
order by id desc
limit 1

-- name: no_jit
-- For the rest of the caller's transaction: no JIT (campaign_holds' estimates pass jit_above_cost; the
-- reads take a few ms, compiling them ~0.5-2 s).
set local jit = off

-- name: campaign_holds
-- Why each scheduled or paused campaign (or only `name`) does not send as planned, read for
-- `mailflow campaign status`, the progress page and the dispatcher's metrics: its last pause event (a
-- paused campaign: who paused it and why; the reputation guard's pause names the scope), the tripped
-- guard rows that hold it (the account's, the campaign's own: the claim statements hold a tripped
-- scope's campaigns whatever their status; a scope whose exposure round is spent and waits for its
-- outcomes), and for a canary not released yet its canary rows (open,
-- deferred by the contact policy, sent, with an outcome; the release rule's inputs, as
-- release_canaries counts them). Each lateral read is gated by its own condition (a one-time filter),
-- and the canary rows are one range of send_log_campaign_user_uq (see release_canaries: `l.id + 0`), so
-- a call costs a few index reads per campaign whatever the send log's size (no_jit first: the estimates
-- pass jit_above_cost, and compiling costs far more than the reads).
select c.id, c.name, c.status, c.emails_per_day,
       p.actor as paused_by, p.reason as paused_reason, p.scope as paused_scope, p.at as paused_at,
       ga.name as account, ga.reason as account_reason, ga.tripped_at as account_tripped_at,
       gc.reason as campaign_reason, gc.tripped_at as campaign_tripped_at,
       c.canary_share, c.canary_last_id, c.canary_min_outcome_share, c.canary_max_wait,
       greatest(c.provisioned_at, c.plan_start) as canary_started,
       k.canary_rows, k.canary_open, k.canary_deferred, k.canary_sent, k.canary_with_outcome, k.canary_last_sent,
       gw.scope as waiting_scope, gw.name as waiting_name, gw.round_sent as waiting_round_sent,
       gw.last_grant_at as waiting_since
from mail.campaign c
left join lateral (select e.actor, e.detail->>'reason' as reason, e.detail->>'scope' as scope, e.at
                   from mail.campaign_event e
                   where c.status = 'paused' and e.campaign_id = c.id and e.to_status = 'paused'
                   order by e.id desc limit 1) as p on true
left join lateral (select g.name, g.reason, g.tripped_at from mail.reputation_guard g
                   where g.state = 'tripped' and g.scope = 'account'
                   order by g.tripped_at, g.name limit 1) as ga on true
left join mail.reputation_guard gc on gc.state = 'tripped' and gc.scope = 'campaign' and gc.name = c.name
left join lateral (select g.scope, g.name, g.round_sent, g.last_grant_at from mail.reputation_guard g
                   where g.waiting and g.state = 'ok'
                     and (g.scope = 'account' or (g.scope = 'campaign' and g.name = c.name))
                   order by g.scope = 'account' desc limit 1) as gw on true
left join lateral (
    select count(*) as canary_rows,
           count(*) filter (where l.status = 'sending'
                               or (l.status = 'pending' and not (starts_with(l.error, 'contact policy:')
                                                                 and l.scheduled_at > now()))) as canary_open,
           count(*) filter (where l.status = 'pending' and starts_with(l.error, 'contact policy:')
                              and l.scheduled_at > now()) as canary_deferred,
           count(*) filter (where l.status = 'sent') as canary_sent,
           count(*) filter (where l.status = 'sent' and ds.outcome is not null) as canary_with_outcome,
           max(l.sent_at) as canary_last_sent
    from mail.send_log l
    left join mail.delivery_status ds on ds.send_log_id = l.id
    where c.canary_share is not null and c.canary_last_id is not null and c.canary_released_at is null
      and l.campaign = c.name and l.id + 0 <= c.canary_last_id and l.released_at is null and l.status <> 'holdout'
      and l.user_id <= (select m.user_id from mail.send_log m where m.id = c.canary_last_id)
) as k on c.canary_share is not null and c.canary_last_id is not null and c.canary_released_at is null
where c.status in ('scheduled', 'paused') and (%(name)s::text is null or c.name = %(name)s)
  and (c.status = 'paused' or ga.name is not null or gc.name is not null or gw.name is not null
       or (c.canary_share is not null and c.canary_released_at is null))
order by c.name

-- name: campaigns_sending
-- The names of the scheduled and paused campaigns (the ones a hold can concern), for the metrics.
select name from mail.campaign where status in ('scheduled', 'paused') order by name

-- name: canaries_waiting
-- Campaigns whose canary is fixed and not released yet (the dispatcher evaluates their reputation
-- before it decides to release them).
select name from mail.campaign
where status = 'scheduled' and canary_share is not null and canary_last_id is not null and canary_released_at is null
order by name

-- name: release_canaries
-- Release the rest of each campaign whose canary is in, judged on the canary rows that can be judged:
-- * open: a canary row in flight (sending), or pending and not deferred (due, or planned later in the
--   plan): the canary waits for it;
-- * deferred: a canary row the contact policy held back to a later slot (pending, its reason starts
--   with 'contact policy:', its new time still ahead): it never holds the canary, since a cooldown can
--   last days (it is sent at its own time, after the release like any other row);
-- The canary is in when nothing is open and either canary_min_outcome_share of its sent emails have an
-- outcome (mail.delivery_status), or nothing was sent and nothing is deferred (every canary row was
-- skipped, cancelled or failed: nothing to wait for), or canary_max_wait has passed since its last send
-- (or, with nothing sent, since the canary started: provisioning fixed it and its plan began). The
-- reputation guard must trip neither the campaign nor the account. Guarded on canary_released_at is
-- null (a release happens once); the event is appended in the same statement. The caller re-plans the
-- released campaigns' overdue rows in the same transaction (the rest waited behind the canary). The
-- waiting campaigns are locked in id order (two dispatchers releasing at once never deadlock).
-- Reads each waiting campaign's canary rows, once per dispatch run, as one range of
-- send_log_campaign_user_uq (campaign, user_id): provisioning creates a campaign's rows in user_id
-- order, so its first rows by id (the canary) are its rows up to the last canary row's user_id. The id
-- bound is written `l.id + 0` so the planner never walks the primary key from the log's first row
-- instead (measured at 2M rows: 1.3 s that way, 19 ms through the campaign's range).
with waiting as (
    select c.id, c.name, c.canary_min_outcome_share, c.canary_max_wait, c.canary_last_id,
           greatest(c.provisioned_at, c.plan_start) as started,
           (select m.user_id from mail.send_log m where m.id = c.canary_last_id) as last_user
    from mail.campaign c
    where c.status = 'scheduled' and c.canary_share is not null and c.canary_last_id is not null
      and c.canary_released_at is null
      and not exists (select 1 from mail.reputation_guard g
                      where g.state = 'tripped' and (g.scope = 'account' or (g.scope = 'campaign' and g.name = c.name)))
    order by c.id
    for update of c
), canary as (
    select w.id, w.name,
           count(*) filter (where l.status = 'sending'
                               or (l.status = 'pending' and not (starts_with(l.error, 'contact policy:')
                                                                 and l.scheduled_at > now()))) as open,
           count(*) filter (where l.status = 'pending' and starts_with(l.error, 'contact policy:')
                              and l.scheduled_at > now()) as deferred,
           count(*) filter (where l.status = 'sent') as sent,
           count(*) filter (where l.status = 'sent' and ds.outcome is not null) as with_outcome,
           max(l.sent_at) as last_sent,
           w.started, w.canary_min_outcome_share, w.canary_max_wait
    from waiting w
    join mail.send_log l on l.campaign = w.name and l.user_id <= w.last_user and l.id + 0 <= w.canary_last_id
                            and l.released_at is null
    left join mail.delivery_status ds on ds.send_log_id = l.id
    group by w.id, w.name, w.started, w.canary_min_outcome_share, w.canary_max_wait
), released as (
    update mail.campaign c set canary_released_at = now(), updated_at = now()
    from canary k
    where c.id = k.id and c.canary_released_at is null and k.open = 0
      and ((k.sent > 0 and k.with_outcome >= ceil(k.canary_min_outcome_share * k.sent))
           or (k.sent = 0 and k.deferred = 0)
           or now() >= coalesce(k.last_sent, k.started) + k.canary_max_wait)
    returning c.id, c.name, k.sent, k.with_outcome, k.deferred, k.last_sent,
              case when k.sent > 0 and k.with_outcome >= ceil(k.canary_min_outcome_share * k.sent)
                   then 'outcomes' when k.sent = 0 and k.deferred = 0 then 'nothing to judge'
                   else 'maximum wait' end as rule
), ev as (
    insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
    select id, 'scheduled', 'scheduled',
           jsonb_build_object('reason', 'canary released', 'rule', rule, 'canary_sent', sent,
                              'canary_with_outcome', with_outcome, 'canary_deferred', deferred,
                              'canary_last_sent', last_sent),
           %(actor)s
    from released
)
select id, name, sent, with_outcome, deferred, rule from released order by name
