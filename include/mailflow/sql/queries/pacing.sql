-- name: claim_slot
-- Claim the next request start slot of a provider account, atomically, in one statement: the row
-- lock lives only for this statement (autocommit), never while a request is in flight.
-- Returns the claimed slot and the database clock, so every sender measures its wait on one clock.
insert into mail.rate_slot as r (account, next_slot)
values (%(account)s, clock_timestamp() + make_interval(secs => %(spacing)s))
on conflict (account) do update
    set next_slot = greatest(r.next_slot, clock_timestamp()) + make_interval(secs => %(spacing)s)
returning next_slot - make_interval(secs => %(spacing)s) as slot, clock_timestamp() as db_now

-- name: push_back
-- Nobody on this account starts a request before now + seconds (after a 429 or remaining = 0).
insert into mail.rate_slot as r (account, next_slot)
values (%(account)s, clock_timestamp() + make_interval(secs => %(seconds)s))
on conflict (account) do update
    set next_slot = greatest(r.next_slot, clock_timestamp() + make_interval(secs => %(seconds)s))
