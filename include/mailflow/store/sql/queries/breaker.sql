-- name: state
-- The breaker of a provider account (one primary-key read): closed when there is no row. A probe
-- lease is live while probe_until lies ahead of the database clock.
select state, opened_at, reason, failures, probe_holder,
       coalesce(probe_until > clock_timestamp(), false) as probing, opened_total, closed_at
from mail.circuit_breaker where account = %(account)s

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
        updated_at = clock_timestamp()
returning failures = 1 as opened_now, opened_at

-- name: close
-- An answer proves the provider processes requests: an open breaker closes and its lease is
-- dropped. A closed breaker is left untouched (no write). Returns the outage it ended.
update mail.circuit_breaker
set state = 'closed', closed_at = clock_timestamp(), closed_by = %(holder)s, probe_holder = null,
    probe_until = null, updated_at = clock_timestamp()
where account = %(account)s and state = 'open'
returning opened_at, reason, failures, clock_timestamp() - opened_at as lasted

-- name: take_probe
-- The probe lease, atomically: only while the breaker is open and nobody else holds a live lease.
-- The row lock of this one statement serialises two takers; the loser gets no row. The lease
-- expires by itself (a holder that dies frees it after lease seconds).
update mail.circuit_breaker
set probe_holder = %(holder)s, probe_until = clock_timestamp() + make_interval(secs => %(lease)s),
    last_probe_at = clock_timestamp(), updated_at = clock_timestamp()
where account = %(account)s and state = 'open'
  and (probe_until is null or probe_until <= clock_timestamp() or probe_holder = %(holder)s)
returning probe_until

-- name: release_probe
-- The holder gives its lease back (its probe ended without an answer either way).
update mail.circuit_breaker set probe_holder = null, probe_until = null, updated_at = clock_timestamp()
where account = %(account)s and probe_holder = %(holder)s
