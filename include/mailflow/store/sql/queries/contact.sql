-- name: ensure_contacts
-- The contact guard, first half: make sure each user has a mail.contact row (then lock_contact_rows
-- locks the rows FOR UPDATE in
-- user_id order (one consistent order for every claimer, so two claimers of overlapping user sets
-- wait for each other instead of deadlocking). Held until the claim transaction ends; the policy is
-- re-checked by the NEXT statement, whose snapshot sees every claim committed before the lock.
insert into mail.contact (user_id)
select u from unnest(%(ids)s::bigint[]) as u order by u
on conflict (user_id) do nothing

-- name: lock_contact_rows
-- The contact guard, second half (a separate statement, so rows inserted by ensure_contacts are
-- visible and lockable): lock the users' rows in user_id order.
select user_id from mail.contact where user_id = any(%(ids)s::bigint[]) order by user_id for update

-- name: contacts_of
-- Every contact of these users that can matter (docs/model.md, "The contact policy"): sent since
-- `since`, in flight ('sending', at = null = now), and with include_planned (lifecycle mail) planned
-- ('pending') before `until`, at its planned time or now if that passed (an overdue planned email
-- goes out as soon as it is dispatched). Excludes the rows being claimed (`except_ids`).
select c.user_id, c.id, c.campaign, c.status,
       case when c.status = 'sent' then c.sent_at
            when c.status = 'pending' then greatest(coalesce(c.scheduled_at, c.minted_at), now()) end as at
from mail.send_log c
where c.user_id = any(%(ids)s::bigint[])
  and c.id <> all(%(except_ids)s::bigint[])
  and ((c.status = 'sent' and c.sent_at >= %(since)s)
       or c.status = 'sending'
       or (%(include_planned)s and c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at) < %(until)s))
order by c.user_id, c.id

-- name: suppressed_addresses
-- Which of these normalised addresses are suppressed for all mail or for this campaign.
select lower(s.email) from mail.suppression s
where lower(s.email) = any(%(keys)s::text[]) and s.scope in ('all', %(campaign)s)

-- name: suppressed_users
-- Which of these users are suppressed (by user: an unsubscribe) for all mail or for this campaign:
-- the mint's re-check of a page read from the run's audience snapshot, which may have aged.
select s.user_id from mail.suppression s
where s.user_id = any(%(ids)s::bigint[]) and s.scope in ('all', %(campaign)s)

-- name: db_now
-- The database clock (the claim's "now").
select now()
