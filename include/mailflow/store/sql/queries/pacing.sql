-- name: claim_slot
-- Claim the next request start slot of a provider account, atomically, in one statement: the row
-- lock lives only for this statement (autocommit), never while a request is in flight.
-- The spacing comes from what the account has learned, not from the caller alone:
-- 1 / (least(configured rps, learned ratelimit-limit) x target_fraction x (1 - decayed 429 penalty)).
-- The slot is no earlier than now + %(lead)s s (the caller's recent round trip, so its answer arrives
-- before the slot starts) and no later than now + %(horizon)s s (the cap on holds plus a queue: a
-- schedule pushed back further, by an older version, is pulled in).
-- Returns the claimed slot and the database clock (every sender measures its wait on one clock),
-- the spacing used (s) and the learned limit (requests/s, or null).
with s as (
    select coalesce((
        select 1.0 / (least(%(rps)s::float8, coalesce(r.limit_per_second, %(rps)s::float8)) * %(fraction)s::float8
                      * (1 - r.penalty * greatest(0, 1 - extract(epoch from clock_timestamp() - r.penalty_at)::float8
                                                          / %(recovery)s::float8)))
        from mail.rate_slot r where r.account = %(account)s), 1.0 / (%(rps)s::float8 * %(fraction)s::float8)) as spacing
)
insert into mail.rate_slot as r (account, next_slot, spacing)
select %(account)s, clock_timestamp() + make_interval(secs => %(lead)s::float8 + s.spacing), s.spacing from s
on conflict (account) do update
    set next_slot = least(greatest(r.next_slot, clock_timestamp() + make_interval(secs => %(lead)s::float8)),
                          clock_timestamp() + make_interval(secs => %(horizon)s::float8))
                    + make_interval(secs => excluded.spacing),
        spacing = excluded.spacing
returning next_slot - make_interval(secs => spacing) as slot, clock_timestamp() as db_now, spacing, limit_per_second

-- name: peek_slot
-- Seconds until the account's next request slot would start if claimed now (0 if it is free now),
-- claiming nothing: the pipelined engine's budget check before a mint. Null if the account is new.
-- At most %(horizon)s s: a claim would pull a further slot in (see claim_slot).
select least(greatest(extract(epoch from r.next_slot - clock_timestamp())::float8, 0), %(horizon)s::float8)
from mail.rate_slot r
where r.account = %(account)s

-- name: push_back
-- Nobody on this account starts a request before now + seconds (ratelimit-remaining: 0), at most
-- %(max_hold)s s (the caller clamps too: never an interval out of range, never a frozen schedule).
insert into mail.rate_slot as r (account, next_slot)
values (%(account)s, clock_timestamp() + make_interval(secs => least(%(seconds)s::float8, %(max_hold)s::float8)))
on conflict (account) do update
    set next_slot = greatest(r.next_slot,
                             clock_timestamp() + make_interval(secs => least(%(seconds)s::float8, %(max_hold)s::float8)))

-- name: rate_limited
-- A 429 rate_limit_exceeded: nobody starts before now + seconds (Retry-After; at most %(max_hold)s s,
-- clamped here as well as by the caller), the 429 is counted,
-- and the shared rate drops by %(step)s of the cap (at most once a second, however many senders saw
-- the same burst; capped at %(max_penalty)s), decaying back over %(recovery)s seconds.
insert into mail.rate_slot as r (account, next_slot, penalty, penalty_at, rate_limited_total, last_rate_limited_at)
values (%(account)s, clock_timestamp() + make_interval(secs => least(%(seconds)s::float8, %(max_hold)s::float8)),
        %(step)s, clock_timestamp(), 1, clock_timestamp())
on conflict (account) do update
    set next_slot = greatest(r.next_slot,
                             clock_timestamp() + make_interval(secs => least(%(seconds)s::float8, %(max_hold)s::float8))),
        penalty = case when r.penalty_at > clock_timestamp() - interval '1 second' then r.penalty
                       else least(%(max_penalty)s::float8,
                                  r.penalty * greatest(0, 1 - extract(epoch from clock_timestamp() - r.penalty_at)::float8
                                                           / %(recovery)s::float8)
                                  + %(step)s::float8) end,
        penalty_at = case when r.penalty_at > clock_timestamp() - interval '1 second' then r.penalty_at
                          else clock_timestamp() end,
        rate_limited_total = r.rate_limited_total + 1,
        last_rate_limited_at = clock_timestamp()

-- name: observe_limit
-- The provider's ratelimit-limit header (requests/s), stored for every sender of the account.
insert into mail.rate_slot as r (account, next_slot, limit_per_second, limit_seen_at)
values (%(account)s, clock_timestamp(), %(limit)s, clock_timestamp())
on conflict (account) do update
    set limit_per_second = excluded.limit_per_second, limit_seen_at = excluded.limit_seen_at

-- name: learned
-- What an account has learned (operations and tests): the limit, the penalty in force now, 429s.
select limit_per_second, limit_seen_at,
       penalty * greatest(0, 1 - extract(epoch from clock_timestamp() - penalty_at)::float8
                                 / %(recovery)s::float8) as penalty_now,
       rate_limited_total, last_rate_limited_at, spacing, next_slot
from mail.rate_slot where account = %(account)s
