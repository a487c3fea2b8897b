-- name: account
-- The provider account the send log sends through: the pacer's account (mail.rate_slot, the API host
-- in production) that claimed a slot last. One row per account; a deployment normally has one.
select account from mail.rate_slot order by next_slot desc limit 1

-- name: no_jit
-- For the rest of the evaluation's transaction: no JIT. The rate statements read a few thousand
-- rows in a few ms, but their whole-window estimates pass jit_above_cost, and compiling them costs
-- ~50 ms, ten times the query.
set local jit = off

-- name: ensure_scopes
-- A guard row (state ok) for each scope not seen before; an existing row is left as it is.
insert into mail.reputation_guard (scope, name)
select s.scope, s.name from unnest(%(scopes)s::text[], %(names)s::text[]) as s(scope, name)
on conflict (scope, name) do nothing

-- name: scopes
-- The guard rows of the scopes being evaluated (no lock: the update below is guarded on what it read);
-- `fresh`: evaluated less than `every` seconds ago (the account scope is then not read again).
select scope, name, state, resumed_at,
       coalesce(evaluated_at > now() - make_interval(secs => %(every)s), false) as fresh
from mail.reputation_guard
where (scope = 'campaign' and name = any(%(campaigns)s::text[])) or (scope = 'account' and name = %(account)s)

-- name: campaign_rates
-- Per campaign, over its most recent `max_sample` sent emails that have an outcome, sent within the
-- window and after the scope's last resume: how many, how many hard-bounced, how many complained.
-- Walks the campaign's sent emails newest first (send_log_campaign_sent_idx (campaign, sent_at)
-- where status = 'sent', backwards) and looks each one's outcome up by mail.delivery_status's primary
-- key; OFFSET 0 keeps that lookup a per-row probe (flattened into a join, the planner hashes the
-- whole outcome table). The walk is bounded twice: at most `walk` newest sent emails (the inner
-- LIMIT also makes the planner read the index in order instead of sorting the whole window), and
-- at most `max_sample` of them with an outcome; so one evaluation costs the same at any size.
select x.name, r.sample, r.hard, r.complaints
from unnest(%(names)s::text[], %(resumed)s::timestamptz[]) as x(name, resumed_at)
cross join lateral (
    select count(*)::int as sample, count(o.hard_bounced_at)::int as hard, count(o.complained_at)::int as complaints
    from (
        select ds.hard_bounced_at, ds.complained_at
        from (select l.id from mail.send_log l
              where l.campaign = x.name and l.status = 'sent'
                and l.sent_at >= greatest(now() - make_interval(secs => %(window)s), x.resumed_at)
              order by l.sent_at desc
              limit %(walk)s) l
        cross join lateral (select d.hard_bounced_at, d.complained_at from mail.delivery_status d
                            where d.send_log_id = l.id and d.outcome is not null offset 0) ds
        limit %(max_sample)s
    ) o
) r

-- name: account_rates
-- The same over every campaign (the send log sends through one provider account): the most recent
-- `max_sample` sent emails with an outcome among the newest `walk`. The send log has no index on
-- sent_at alone (0011), so as mail.sent_email does: the campaign names by a skip scan of
-- send_log_campaign_sent_idx, each campaign's newest `walk` sends by its own index range read
-- backwards, the newest `walk` of those, then the per-row outcome probe. A handful of campaigns:
-- a handful of short index ranges, never the whole table.
with recursive seen (campaign) as (
    (select x.campaign from mail.send_log x where x.status = 'sent' order by x.campaign limit 1)
    union all
    select (select x.campaign from mail.send_log x
            where x.status = 'sent' and x.campaign > s.campaign order by x.campaign limit 1)
    from seen s
    where s.campaign is not null
), newest as (
    select l.id, l.sent_at
    from seen s
    cross join lateral (select l.id, l.sent_at from mail.send_log l
                        where l.campaign = s.campaign and l.status = 'sent'
                          and l.sent_at >= greatest(now() - make_interval(secs => %(window)s),
                                                    %(resumed)s::timestamptz)
                        order by l.sent_at desc
                        limit %(walk)s) l
    where s.campaign is not null
    order by l.sent_at desc
    limit %(walk)s
)
select count(*)::int as sample, count(o.hard_bounced_at)::int as hard, count(o.complained_at)::int as complaints
from (
    select ds.hard_bounced_at, ds.complained_at
    from newest l
    cross join lateral (select d.hard_bounced_at, d.complained_at from mail.delivery_status d
                        where d.send_log_id = l.id and d.outcome is not null offset 0) ds
    limit %(max_sample)s
) o

-- name: record
-- Store each scope's rates and, where `trip` says so, trip it. Guarded: only a scope still 'ok' and
-- not resumed since its rates were read changes, so of two evaluators at once exactly one trips it
-- (the second waits for the first's row lock, then finds the row tripped and changes nothing). A
-- tripped scope stays tripped: only resume() sets it back.
update mail.reputation_guard g
set hard_bounce_rate = r.hard_rate, complaint_rate = r.complaint_rate, sample = r.sample, evaluated_at = now(),
    state = case when r.trip then 'tripped' else 'ok' end,
    tripped_at = case when r.trip then now() else g.tripped_at end,
    reason = case when r.trip then r.reason else g.reason end,
    alerted_at = case when r.trip then null else g.alerted_at end
from unnest(%(scopes)s::text[], %(names)s::text[], %(samples)s::int[], %(hard_rates)s::numeric[],
            %(complaint_rates)s::numeric[], %(trips)s::boolean[], %(reasons)s::text[], %(resumed)s::timestamptz[])
     as r(scope, name, sample, hard_rate, complaint_rate, trip, reason, resumed_at)
where g.scope = r.scope and g.name = r.name and g.state = 'ok' and g.resumed_at is not distinct from r.resumed_at
returning g.scope, g.name, g.state = 'tripped' and r.trip as tripped_now, g.tripped_at

-- name: pause_campaigns
-- Pause the scheduled campaigns a trip stops (one campaign, or every one for an account trip), in
-- the trip's transaction, with one campaign event each (actor reputation_guard, the rates in detail).
-- Rows locked in id order (two trips at once never deadlock); guarded on status = 'scheduled'.
with target as materialized (
    select id from mail.campaign
    where status = 'scheduled' and (%(all)s or name = %(name)s)
    order by id
    for update
), paused as (
    update mail.campaign c set status = 'paused', updated_at = now()
    from target t where c.id = t.id and c.status = 'scheduled'
    returning c.id, c.name
), ev as (
    insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
    select id, 'scheduled', 'paused', %(detail)s::jsonb, 'reputation_guard' from paused
)
select name from paused order by name

-- name: blocked
-- Why a campaign may not send now: its own scope or the account tripped (the account first). Reads
-- reputation_guard_tripped_idx (only tripped rows).
select scope, name, reason, tripped_at
from mail.reputation_guard
where state = 'tripped' and (scope = 'account' or (scope = 'campaign' and name = %(campaign)s))
order by scope = 'account' desc, tripped_at
limit 1

-- name: resume
-- A person resumes a scope: state ok, who, when and why. The trip's time and reason stay as history;
-- outcomes of emails sent before resumed_at no longer count. Row-locked by the update.
update mail.reputation_guard
set state = 'ok', resumed_at = now(), resumed_by = %(actor)s, resume_reason = %(reason)s
where scope = %(scope)s and name = %(name)s and state = 'tripped'
returning resumed_at

-- name: scope_exists
-- Whether the guard has a row for the scope (tripped or not).
select state from mail.reputation_guard where scope = %(scope)s and name = %(name)s

-- name: guard_paused
-- The paused scheduled campaigns the guard paused (their last pause event's actor is
-- reputation_guard) that nothing trips any more: the ones a resume sets back to scheduled. Locked in
-- id order. `name` null: every such campaign (an account resume).
select c.id, c.name
from mail.campaign c
where c.status = 'paused' and (%(name)s::text is null or c.name = %(name)s)
  and (select e.actor from mail.campaign_event e
       where e.campaign_id = c.id and e.to_status = 'paused' order by e.id desc limit 1) = 'reputation_guard'
  and not exists (select 1 from mail.reputation_guard g
                  where g.state = 'tripped' and (g.scope = 'account' or (g.scope = 'campaign' and g.name = c.name)))
order by c.id
for update of c

-- name: guard_held
-- The scheduled campaigns a resumed scope held without pausing them (provisioned, or resumed by a
-- person, while it was tripped: the claim statements hold every campaign of a tripped scope whatever
-- its status) that nothing trips any more: a resume re-plans their overdue rows, as it does for the
-- campaigns it unpauses. Locked in id order. `name` null: every scheduled campaign (an account resume).
select c.id, c.name
from mail.campaign c
where c.status = 'scheduled' and (%(name)s::text is null or c.name = %(name)s)
  and not exists (select 1 from mail.reputation_guard g
                  where g.state = 'tripped' and (g.scope = 'account' or (g.scope = 'campaign' and g.name = c.name)))
order by c.id
for update of c

-- name: unpause
-- Set one guard-paused campaign back to scheduled, with its event (guarded on paused). Used when no
-- re-planning resume is given; the CLI and the DAG re-plan overdue rows instead (control.resume).
with done as (
    update mail.campaign set status = 'scheduled', updated_at = now()
    where id = %(id)s and status = 'paused'
    returning id
)
insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
select id, 'paused', 'scheduled', %(detail)s::jsonb, %(actor)s from done
returning campaign_id

-- name: status
-- Every guard row, tripped first, then by scope and name.
select scope, name, state, hard_bounce_rate, complaint_rate, sample, evaluated_at, tripped_at, reason,
       resumed_at, resumed_by, resume_reason, alerted_at
from mail.reputation_guard
order by state = 'tripped' desc, scope, name

-- name: unalerted
-- Trips not put in an alert yet, oldest first; locked (SKIP LOCKED: two alerting runs never send
-- the same trip twice) until the alert is sent and alerted_at is set in the same transaction.
select scope, name, reason, hard_bounce_rate, complaint_rate, sample, tripped_at
from mail.reputation_guard
where state = 'tripped' and alerted_at is null
order by tripped_at, scope, name
for update skip locked

-- name: mark_alerted
-- The trips just alerted (guarded: still tripped and not alerted).
update mail.reputation_guard set alerted_at = now()
from unnest(%(scopes)s::text[], %(names)s::text[]) as a(scope, name)
where reputation_guard.scope = a.scope and reputation_guard.name = a.name
  and reputation_guard.state = 'tripped' and reputation_guard.alerted_at is null
