-- name: state
-- The breaker of a provider account (one primary-key read): closed when there is no row. A probe
-- lease is live while probe_until lies ahead of the database clock.
select state, opened_at, reason, failures, probe_holder,
       coalesce(probe_until > clock_timestamp()
                and exists (select 1 from pg_stat_activity a where a.pid = b.probe_pid), false) as probing,
       opened_total, closed_at
from mail.circuit_breaker b where account = %(account)s

-- name: open
-- A whole-request failure: the breaker opens (or stays open with one more failure counted). The
-- first failure sets opened_at; the reason is always the latest. A probe lease of the same holder
-- is given up (its probe has failed). Returns whether this statement opened it.
insert into mail.circuit_breaker as b (account, state, opened_at, reason, failures, opened_total, updated_at)
values (%(account)s, 'open', clock_timestamp(), %(reason)s, 1, 1, clock_timestamp())
on conflict (account) do update
    set opened_at = case when b.state = 'closed' then clock_timestamp() else b.opened_at end,
        opened_total = b.opened_total + case when b.state = 'closed' then 1 else 0 end,
        failures = case when b.state = 'closed' then 1 else b.failures + 1 end,
        state = 'open',
        reason = excluded.reason,
        probe_holder = case when b.probe_holder = %(holder)s then null else b.probe_holder end,
        probe_until = case when b.probe_holder = %(holder)s then null else b.probe_until end,
        probe_pid = case when b.probe_holder = %(holder)s then null else b.probe_pid end,
        updated_at = clock_timestamp()
returning failures = 1 as opened_now, opened_at

-- name: close
-- An answer proves the provider processes requests: an open breaker closes and its lease is
-- dropped. A closed breaker is left untouched (no write). Returns the outage it ended.
update mail.circuit_breaker
set state = 'closed', closed_at = clock_timestamp(), closed_by = %(holder)s, probe_holder = null,
    probe_until = null, probe_pid = null, updated_at = clock_timestamp()
where account = %(account)s and state = 'open'
returning opened_at, reason, failures, clock_timestamp() - opened_at as lasted

-- name: take_probe
-- The probe lease, atomically: only while the breaker is open and nobody else holds a live lease.
-- The row lock of this one statement serialises two takers; the loser gets no row. The lease
-- expires by itself after lease seconds, and at once when the holder's session is gone (a killed
-- process: its backend pid is no longer in pg_stat_activity).
update mail.circuit_breaker b
set probe_holder = %(holder)s, probe_until = clock_timestamp() + make_interval(secs => %(lease)s),
    probe_pid = pg_backend_pid(), last_probe_at = clock_timestamp(), updated_at = clock_timestamp()
where b.account = %(account)s and b.state = 'open'
  and (b.probe_until is null or b.probe_until <= clock_timestamp() or b.probe_holder = %(holder)s
       or b.probe_pid is null
       or not exists (select 1 from pg_stat_activity a where a.pid = b.probe_pid))
returning b.probe_until

-- name: release_probe
-- The holder gives its lease back (its probe ended without an answer either way).
update mail.circuit_breaker set probe_holder = null, probe_until = null, probe_pid = null,
    updated_at = clock_timestamp()
where account = %(account)s and probe_holder = %(holder)s

-- name: dead_letters
-- Dead letters nobody has decided on yet (a row dead-lettered again after a decision counts again),
-- oldest first, with the batch they belonged to. Read by `mailflow dead-letters list`.
select l.id, l.kind, l.campaign, l.user_id, l.idempotency_key, l.dead_lettered_at, l.error
from mail.send_log l
where l.dead_lettered_at is not null and l.status = 'failed'
  and (l.dead_letter_decided_at is null or l.dead_letter_decided_at < l.dead_lettered_at)
  and (%(ids)s::bigint[] is null or l.id = any(%(ids)s::bigint[]))
  and (%(campaign)s::text is null or l.campaign = %(campaign)s)
order by l.dead_lettered_at, l.id

-- name: dead_letter_resend
-- A person re-opens dead letters under a NEW key, accepting the risk of a duplicate (the provider
-- may have processed the old key): lifecycle rows are released (they leave the unique key; ambiguous_at
-- stays as history) so the next run's audience decides again; scheduled rows go back to pending
-- without their key or ambiguity, keeping their place in the plan. Either way the row is no longer
-- a dead letter (dead_lettered_at cleared; the event of its dead-lettering stays). The decision and
-- who took it are stored on the row and appended as an event with the old key; nothing is deleted.
-- A scheduled row is only re-opened where something dispatches it: its campaign is locked (a cancel
-- in progress is waited for and seen); a completed campaign goes back to 'scheduled' (with an event)
-- so the dispatcher claims the row and completes it again afterwards; in a cancelled campaign the
-- row becomes 'cancelled' (a pending row there would never be picked up).
with camp as materialized (
    select k.id, k.name, k.status
    from mail.campaign k
    where k.name in (select d.campaign from mail.send_log d
                     where d.id = any(%(ids)s::bigint[]) and d.kind = 'scheduled'
                       and d.dead_lettered_at is not null and d.status = 'failed')
    for update of k
), rescheduled as (
    update mail.campaign k set status = 'scheduled', updated_at = now()
    where k.id in (select id from camp where status = 'completed')
    returning k.id
), rescheduled_event as (
    insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
    select id, 'completed', 'scheduled',
           jsonb_build_object('reason', 'dead letters re-opened for a resend by ' || %(who)s || ': ' || %(why)s),
           'mailflow dead-letters resend'
    from rescheduled
), changed as (
    update mail.send_log l
    set status = case when l.kind = 'scheduled'
                           and l.campaign in (select name from camp where status = 'cancelled') then 'cancelled'
                      when l.kind = 'scheduled' then 'pending' else 'failed' end,
        released_at = case when l.kind = 'lifecycle' then now() end,
        idempotency_key = case when l.kind = 'scheduled' then null else l.idempotency_key end,
        batch_index = case when l.kind = 'scheduled' then null else l.batch_index end,
        ambiguous_at = case when l.kind = 'scheduled' then null else l.ambiguous_at end,
        dead_lettered_at = null,
        dead_letter_decision = 'resend', dead_letter_decided_at = now(), dead_letter_decided_by = %(who)s,
        error = 'dead letter re-opened for a resend under a new key by ' || %(who)s || ': ' || %(why)s
                || ' (was ' || coalesce(l.idempotency_key, 'no key') || ')'
                || case when l.kind = 'scheduled' and l.campaign in (select name from camp where status = 'cancelled')
                        then ' (campaign cancelled: not returned to pending)' else '' end
    where l.id = any(%(ids)s::bigint[]) and l.dead_lettered_at is not null and l.status = 'failed'
      and (l.dead_letter_decided_at is null or l.dead_letter_decided_at < l.dead_lettered_at)
    returning l.id, l.attempts, l.status, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'failed', status, attempts, error, null, null, 'mailflow dead-letters resend' from changed
returning send_log_id

-- name: dead_letter_close
-- A person closes dead letters: they stay failed for good (the user is not mailed this campaign
-- again), with the decision, who and why on the row and as an event.
with changed as (
    update mail.send_log l
    set dead_letter_decision = 'close', dead_letter_decided_at = now(), dead_letter_decided_by = %(who)s,
        error = l.error || '; closed by ' || %(who)s || ': ' || %(why)s
    where l.id = any(%(ids)s::bigint[]) and l.dead_lettered_at is not null and l.status = 'failed'
      and (l.dead_letter_decided_at is null or l.dead_letter_decided_at < l.dead_lettered_at)
    returning l.id, l.attempts, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'failed', 'failed', attempts, error, null, null, 'mailflow dead-letters close' from changed
returning send_log_id

-- name: breakers
-- Every account's breaker (operations: `mailflow breaker`).
select account, state, opened_at, reason, failures, opened_total, probe_holder, probe_until, closed_at, closed_by
from mail.circuit_breaker order by account
