-- name: account
-- The provider account the send log sends through, for a caller without a provider (the webhook
-- receiver): the account scope the senders were granted emails on last (the name they use, whatever
-- their pacer or environment), else the pacer's account (mail.rate_slot, the API host in production)
-- that claimed a slot last. A deployment normally has one of each.
select name from (
    (select name, 1 as rank from mail.reputation_guard
     where scope = 'account' and last_grant_at is not null order by last_grant_at desc limit 1)
    union all
    (select account, 2 from mail.rate_slot order by next_slot desc limit 1)
) as a
order by rank
limit 1

-- name: no_jit
-- For the rest of the evaluation's transaction: no JIT. The rate statements read a few thousand
-- rows in a few ms, but their whole-window estimates pass jit_above_cost, and compiling them costs
-- ~50 ms, ten times the query.
set local jit = off

-- name: now
-- The database clock, in epoch seconds (the complaint test's marks and the exposure rounds use it).
select extract(epoch from now())::float8

-- name: existing
-- Which of the scopes have a guard row.
select scope, name from mail.reputation_guard g
where (g.scope, g.name) in (select * from unnest(%(scopes)s::text[], %(names)s::text[]))

-- name: ensure_scopes
-- A guard row (state ok, not proven) for each scope not seen before, its baseline the counters now; an
-- existing row is left as it is.
insert into mail.reputation_guard (scope, name, seen, delivered_marks)
select s.scope, s.name, s.seen, s.marks
from unnest(%(scopes)s::text[], %(names)s::text[], %(seen)s::jsonb[], %(marks)s::jsonb[]) as s(scope, name, seen, marks)
on conflict (scope, name) do nothing

-- name: lock_scopes
-- The guard rows of the scopes, locked for the read-modify-write of their statistics, account first,
-- then the campaigns by name (every locker takes them in this order: no deadlock). `fresh`: evaluated
-- less than `every` seconds ago and not waiting for its round's outcomes (the account scope is then not
-- read again).
select g.*, extract(epoch from g.last_grant_at)::float8 as last_grant_epoch,
       coalesce(g.evaluated_at > now() - make_interval(secs => %(every)s), false) and not g.waiting as fresh
from mail.reputation_guard g
where (g.scope, g.name) in (select * from unnest(%(scopes)s::text[], %(names)s::text[]))
order by g.scope = 'account' desc, g.name
for update of g

-- name: read_scopes
-- The guard rows of the scopes, not locked (admit's first look: are both proven?).
select g.scope, g.name, g.proven
from mail.reputation_guard g
where (g.scope, g.name) in (select * from unnest(%(scopes)s::text[], %(names)s::text[]))

-- name: share_scopes
-- The guard rows of the scopes, share-locked in lock_scopes' order: senders of proven scopes hold them
-- together; an evaluation's lock_scopes (FOR UPDATE) waits for them, and they for it.
select g.scope, g.name, g.proven
from mail.reputation_guard g
where (g.scope, g.name) in (select * from unnest(%(scopes)s::text[], %(names)s::text[]))
order by g.scope = 'account' desc, g.name
for share of g

-- name: campaign_counts
-- The outcome counters now, per campaign (mail.campaign_counts: folded counts plus the unfolded deltas),
-- in the order of `keys`: the campaigns `names`, or every campaign when `names` is null (the account's
-- counters are their sum). One pass over the counters and the deltas.
select x.campaign,
       coalesce(sum(x.n) filter (where x.key = (%(keys)s::text[])[1]), 0)::bigint,
       coalesce(sum(x.n) filter (where x.key = (%(keys)s::text[])[2]), 0)::bigint,
       coalesce(sum(x.n) filter (where x.key = (%(keys)s::text[])[3]), 0)::bigint,
       coalesce(sum(x.n) filter (where x.key = (%(keys)s::text[])[4]), 0)::bigint,
       coalesce(sum(x.n) filter (where x.key = (%(keys)s::text[])[5]), 0)::bigint
from mail.campaign_counts x
where (%(names)s::text[] is null or x.campaign = any(%(names)s::text[])) and x.key = any(%(keys)s::text[])
group by x.campaign

-- name: store
-- One scope's statistics after an evaluation (its row is locked by lock_scopes); `trip`: it trips now.
-- A tripped scope stays tripped: only a resume sets it back.
update mail.reputation_guard
set llr_bounce = %(llr_bounce)s, llr_gross = %(llr_gross)s, llr_complaint = %(llr_complaint)s,
    proven = %(proven)s and not %(trip)s, seen = %(seen)s, delivered_marks = %(marks)s, evidence = %(evidence)s,
    cum_outcomes = %(cum_outcomes)s, cum_hard = %(cum_hard)s, cum_complaints = %(cum_complaints)s,
    cum_delivered = %(cum_delivered)s, awaiting = %(awaiting)s,
    round_sent = %(round_sent)s, round_outcomes = %(round_outcomes)s,
    round_started_at = case when %(round_sent)s = 0 then null else round_started_at end,
    waiting = %(waiting)s and not %(trip)s,
    hard_bounce_rate = %(hard_rate)s, complaint_rate = %(complaint_rate)s, sample = %(cum_outcomes)s,
    evaluated_at = now(),
    state = case when %(trip)s then 'tripped' else state end,
    tripped_at = case when %(trip)s then now() else tripped_at end,
    reason = case when %(trip)s then %(reason)s else reason end,
    alerted_at = case when %(trip)s then null else alerted_at end
where scope = %(scope)s and name = %(name)s and state = 'ok'
returning tripped_at

-- name: grant
-- Count a grant in a scope's exposure round (its row is locked by lock_scopes): a round starting now
-- records the outcome count it starts from (`base`); `waiting`: the round is spent. A refusal (n = 0)
-- is no grant: the outcome wait keeps counting from the round's last real grant.
update mail.reputation_guard
set round_sent = round_sent + %(n)s, waiting = %(waiting)s,
    last_grant_at = case when %(n)s > 0 then now() else last_grant_at end,
    round_started_at = case when %(n)s > 0 then coalesce(round_started_at, now()) else round_started_at end,
    round_outcomes = coalesce(%(base)s, round_outcomes)
where scope = %(scope)s and name = %(name)s and not proven

-- name: refund
-- Give back emails granted but not sent, in the campaign's and the account's rounds. The rows are locked
-- first in lock_scopes' order (account, then campaign): an UPDATE of both would lock them in scan order
-- and could deadlock with a concurrent admit. A proven scope has no round and is not locked (a claim
-- holds it share-locked: upgrading that lock could deadlock with another claim's).
with locked as materialized (
    select g.scope, g.name from mail.reputation_guard g
    where ((g.scope = 'campaign' and g.name = %(campaign)s) or (g.scope = 'account' and g.name = %(account)s))
      and not g.proven
    order by g.scope = 'account' desc, g.name
    for update of g
)
update mail.reputation_guard g
set round_sent = greatest(0, g.round_sent - %(n)s), waiting = false
from locked l
where g.scope = l.scope and g.name = l.name and not g.proven and g.round_sent > 0

-- name: waiting
-- The scopes whose exposure round is spent, campaigns and accounts (the dispatcher evaluates them at
-- each run: the claim statements skip every campaign while an account waits).
select scope, name from mail.reputation_guard where waiting and state = 'ok' order by scope, name

-- name: setting
-- One provider account's guard settings (null: the default).
select hard_bounce_rate, complaint_rate, exposure, complaint_lag_hours
from mail.reputation_setting where account = %(account)s

-- name: set_setting
-- Store one provider account's guard settings (null: the default), with who set them.
insert into mail.reputation_setting (account, hard_bounce_rate, complaint_rate, exposure, complaint_lag_hours,
                                     updated_by)
values (%(account)s, %(hard_bounce_rate)s, %(complaint_rate)s, %(exposure)s, %(complaint_lag_hours)s, %(actor)s)
on conflict (account) do update
set hard_bounce_rate = excluded.hard_bounce_rate, complaint_rate = excluded.complaint_rate,
    exposure = excluded.exposure, complaint_lag_hours = excluded.complaint_lag_hours,
    updated_at = now(), updated_by = excluded.updated_by

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
-- outcomes of emails sent before resumed_at no longer count. What is delivered from now on is fresh
-- in the complaint test (its first complaint-lag mark is now). Row-locked by the update.
update mail.reputation_guard
set state = 'ok', resumed_at = now(), resumed_by = %(actor)s, resume_reason = %(reason)s,
    llr_bounce = 0, llr_gross = 0, llr_complaint = 0, proven = false, seen = %(seen)s,
    delivered_marks = jsonb_build_array(jsonb_build_array(extract(epoch from now())::float8, 0::float8)),
    evidence = 0, cum_outcomes = 0, cum_hard = 0, cum_complaints = 0,
    cum_delivered = 0, round_sent = 0, round_outcomes = null, round_started_at = null, waiting = false,
    sample = 0, hard_bounce_rate = 0, complaint_rate = 0
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
       resumed_at, resumed_by, resume_reason, alerted_at, proven, waiting, round_sent, awaiting,
       llr_bounce, llr_gross, llr_complaint, cum_hard, cum_complaints, cum_delivered
from mail.reputation_guard
order by state = 'tripped' desc, scope, name

-- name: unalerted
-- Trips not put in an alert yet, oldest first; locked (SKIP LOCKED: two alerting runs never send
-- the same trip twice) until the alert is sent and alerted_at is set in the same transaction.
select scope, name, reason, hard_bounce_rate, complaint_rate, sample, cum_delivered, tripped_at
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
