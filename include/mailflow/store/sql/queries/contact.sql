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
-- goes out as soon as it is dispatched), unless its campaign is paused, cancelled or completed: such
-- a campaign sends nothing, so its pending rows are nobody's contact (a paused one's are re-checked
-- under this guard when they are claimed after a resume). Excludes the rows being claimed
-- (`except_ids`).
select c.user_id, c.id, c.campaign, c.status,
       case when c.status = 'sent' then c.sent_at
            when c.status = 'pending' then greatest(coalesce(c.scheduled_at, c.minted_at), now()) end as at
from mail.send_log c
where c.user_id = any(%(ids)s::bigint[])
  and c.id <> all(%(except_ids)s::bigint[])
  and ((c.status = 'sent' and c.sent_at >= %(since)s)
       or c.status = 'sending'
       or (%(include_planned)s and c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at) < %(until)s
           and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed'))))
order by c.user_id, c.id

-- name: suppressed_addresses
-- Which of these mailbox keys are suppressed for all mail or for this campaign: stored keys compared
-- as stored (mailflow.store.policy.mailbox_key; never lower(), which depends on the locale).
-- One probe of suppression_email_key_scope_uq (email_key, scope) per key (a nested-loop semi-join
-- over the keys): the planner costs `email_key = any(keys)` at ~2,000 rows and reads the whole
-- table instead (20k rows at 1M users: 2.4-3.8 ms a chunk, against 0.2-0.8 ms).
select k.key from unnest(%(keys)s::text[]) as k(key)
where exists (select 1 from mail.suppression s
              where s.email_key = k.key and s.scope in ('all', %(campaign)s))

-- name: suppressed_users
-- Which of these users are suppressed (by user: an unsubscribe) for all mail or for this campaign:
-- the mint's re-check of a page read from the run's audience snapshot, which may have aged.
select s.user_id from mail.suppression s
where s.user_id = any(%(ids)s::bigint[]) and s.scope in ('all', %(campaign)s)

-- name: ensure_mailboxes
-- The contact guard for mailboxes, run after lock_contact_rows (users first, then mailboxes, each
-- set in key order: every claimer takes its locks in this one global order, so claimers of
-- overlapping users or mailboxes wait for each other and never deadlock). Two user ids at one
-- mailbox then serialise like two claims of one user.
insert into mail.mailbox (email_key)
select k from unnest(%(keys)s::text[]) as k order by k collate "C"
on conflict (email_key) do nothing

-- name: lock_mailbox_rows
-- Second half of ensure_mailboxes (a separate statement, so the rows it inserted are lockable):
-- lock the mailboxes' rows in key order (byte order, whatever the database's collation).
select email_key from mail.mailbox where email_key = any(%(keys)s::text[])
order by email_key collate "C" for update

-- name: mailbox_contacts
-- contacts_of for mailboxes: every contact that can matter at these mailbox keys, whoever the user
-- (the same bounds and states as contacts_of), with the row's user: the guard adds a mailbox's
-- contacts of OTHER users to each of its claimers' own (send_log_mailbox_idx, 0018).
select c.email_key, c.user_id, c.id, c.campaign, c.status,
       case when c.status = 'sent' then c.sent_at
            when c.status = 'pending' then greatest(coalesce(c.scheduled_at, c.minted_at), now()) end as at
from mail.send_log c
where c.email_key = any(%(keys)s::text[])
  and c.id <> all(%(except_ids)s::bigint[])
  and ((c.status = 'sent' and c.sent_at >= %(since)s)
       or c.status = 'sending'
       or (%(include_planned)s and c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at) < %(until)s
           and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed'))))
order by c.email_key, c.id

-- name: mailbox_contact_times
-- contact_times for mailboxes (the lifecycle mint): (email_key, user_id, 0, '', status, at), an
-- index-only scan of send_log_mailbox_idx (email_key, sent_at) INCLUDE (status, scheduled_at,
-- minted_at, user_id, campaign); the same bounds as contact_times.
select c.email_key, c.user_id, 0::bigint as id, ''::text as campaign, c.status,
       case when c.status = 'sent' then c.sent_at
            when c.status = 'pending' then greatest(coalesce(c.scheduled_at, c.minted_at), now()) end as at
from mail.send_log c
where c.email_key = any(%(keys)s::text[])
  and c.status in ('pending', 'sending', 'sent')
  and ((c.status = 'sent' and c.sent_at >= least(%(ref)s::timestamptz, now()) - %(widest)s::interval)
       or c.status = 'sending'
       or (%(include_planned)s and c.status = 'pending'
           and coalesce(c.scheduled_at, c.minted_at) < now() + %(widest)s::interval
           and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed'))))
order by c.email_key

-- name: db_now
-- The database clock (the claim's "now").
select now()

-- name: contact_times
-- The lifecycle mint's form of contacts_of: the same rows, but only (user_id, status, at), so it is
-- an index-only scan of send_log_contact_idx (user_id, sent_at) INCLUDE (status, scheduled_at,
-- minted_at, campaign): the filter is evaluated on the index tuples and no heap page is read for the nine tenths of
-- a user's history outside the window (contacts_of, which also returns id and campaign for the
-- scheduled path's hold reasons, fetched ~9 heap pages per user: 20 ms a chunk at 5M rows). The
-- lifecycle mint needs no reason: a held user gets no row. id 0 and campaign '' fill the shape.
-- The bounds are contacts_of's, with the claim's "now" = now() (the transaction's start, the value
-- contact.db_now returns): sent since least(ref, now) - widest, planned before now + widest.
select c.user_id, 0::bigint as id, ''::text as campaign, c.status,
       case when c.status = 'sent' then c.sent_at
            when c.status = 'pending' then greatest(coalesce(c.scheduled_at, c.minted_at), now()) end as at
from mail.send_log c
where c.user_id = any(%(ids)s::bigint[])
  and c.status in ('pending', 'sending', 'sent')
  and ((c.status = 'sent' and c.sent_at >= least(%(ref)s::timestamptz, now()) - %(widest)s::interval)
       or c.status = 'sending'
       or (%(include_planned)s and c.status = 'pending'
           and coalesce(c.scheduled_at, c.minted_at) < now() + %(widest)s::interval
           and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed'))))
order by c.user_id
