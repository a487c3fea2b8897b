-- name: eligible
-- A campaign's audience after the engine's exclusions: the one place every campaign is wrapped.
-- The audience placeholder takes the campaign's own, version-controlled SQL; every value is bound.
-- Exclusions (each a top-level NOT EXISTS, so the planner turns every one into an anti-join and
-- can hash a whole set once instead of probing per candidate; docs/performance.md):
--   dedupe:      the user already has a live row for this campaign (unique key send_log_user_campaign_uq);
--   (no attempts clause: a whole-request failure never charges a user; only a rejection of that
--    exact email or an unknown outcome past the idempotency window excludes one, and both keep
--    the live unique key, so `dedupe` covers them; docs/model.md)
--   policy:      the contact policy pre-filter (lifecycle.eligible_policy: cooldown and one
--                lifecycle.eligible_cap per frequency cap the cooldown does not imply); empty for
--                an exempt campaign (transactional mail, `policy = "exempt"`);
--   suppression: the user or the (trimmed, case-folded) address is suppressed for all mail or for
--                this campaign.
-- This is the pre-filter (the audience snapshot); the authoritative check is repeated per user at
-- mint, under the contact guard (store.mint_chunk).
select a.user_id, a.email, to_jsonb(a) - 'user_id' - 'email' as context
from (
{audience}
) as a
where not exists (select 1 from mail.send_log d
                  where d.user_id = a.user_id and d.campaign = %(campaign)s and d.released_at is null)
  {policy}
  and not exists (select 1 from mail.suppression s
                  where s.user_id = a.user_id and s.scope in ('all', %(campaign)s))
  and not exists (select 1 from mail.suppression s
                  where s.email is not null and lower(s.email) = lower(btrim(a.email, E' \t\r\n'))
                    and s.scope in ('all', %(campaign)s))

-- name: eligible_policy
-- The cooldown part of lifecycle.eligible (composed in unless the campaign is exempt): any
-- campaign's email within the cooldown of the email's decision: sent since cooldown_since =
-- interval end - cooldown (no upper bound, so a backfill also sees what was sent after its
-- interval), in flight ('sending'), or planned ('pending') before cooldown_until = greatest(interval
-- end, now()) + cooldown: measured from the ACTUAL send time (now), so a backfill never sends inside
-- a planned email's cooldown. Two anti-joins: "sent since" is one range of send_log_sent_idx (read
-- once and hashed), the in-flight/planned rows one range of send_log_open_idx. Then the caps.
and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status in ('pending', 'sending')
                    and (c.status = 'sending'
                         or coalesce(c.scheduled_at, c.minted_at)
                            < greatest(%(cooldown_until)s::timestamptz, now() + %(cooldown)s::interval)))
  {caps}

-- name: eligible_cap
-- One frequency cap (N emails per window W) the cooldown does not imply, set-based: the users with
-- at least N contacts within W of the email (sent since cap_since, in flight, or planned before
-- greatest(cap_until, now() + W)), counted once over three index ranges (send_log_sent_idx,
-- send_log_open_idx) and grouped, then anti-joined. A correlated count per candidate cost ~10 us
-- each, i.e. seconds for a large audience (docs/performance.md).
and not exists (
      select 1 from (
          select x.user_id from (
              select c.user_id from mail.send_log c where c.status = 'sent' and c.sent_at >= {since}
              union all
              select c.user_id from mail.send_log c
              where c.status in ('pending', 'sending')
                and (c.status = 'sending'
                     or coalesce(c.scheduled_at, c.minted_at) < greatest({until}::timestamptz, now() + {window}::interval))
          ) as x
          group by x.user_id
          having count(*) >= {emails}
      ) as k
      where k.user_id = a.user_id)

-- name: audience_page
-- The next page of the eligible audience in user_id order (keyset pagination: each page is an
-- index range and the run always makes progress, even if a minted row later loses a race).
select e.user_id, e.email, e.context
from (
{eligible}
) as e
where e.user_id > %(after)s
order by e.user_id
limit %(limit)s

-- name: snapshot_create
-- The run's audience snapshot of one campaign (issue 16): a temporary table of this session, keyed
-- by user_id, dropped when the campaign ends (or with the session). The table's name is generated.
create temp table {snapshot} (user_id bigint primary key, email text, context jsonb) on commit preserve rows

-- name: snapshot_fill
-- Evaluate the campaign's audience ONCE for this run into the snapshot: lifecycle.eligible without
-- its contact-policy part (dedupe and suppression: anti-joins), which snapshot_policy then applies
-- in one pass over the candidates' contacts. A user listed twice by an audience file counts once.
insert into {snapshot} (user_id, email, context)
select e.user_id, e.email, e.context
from (
{eligible}
) as e
on conflict (user_id) do nothing

-- name: snapshot_policy
-- The contact-policy pre-filter of lifecycle.eligible_policy / eligible_cap (same rules, same
-- rows), set-based over the snapshot's candidates only: one join of the snapshot with their
-- contacts (send_log_contact_idx, index-only), grouped by user; a user with an email in flight, one
-- sent since cooldown_since, one planned before greatest(cooldown_until, now() + cooldown), or at
-- least N contacts within a frequency cap's window (snapshot_cap) is removed. Not run for an exempt
-- campaign.
delete from {snapshot} t
using (
    select s.user_id
    from {snapshot} s
    join mail.send_log c on c.user_id = s.user_id and c.status in ('pending', 'sending', 'sent')
    group by s.user_id
    having bool_or(c.status = 'sending')
        or bool_or(c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
        or bool_or(c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at)
                                             < greatest(%(cooldown_until)s::timestamptz, now() + %(cooldown)s::interval))
        {caps}
) as held
where t.user_id = held.user_id

-- name: snapshot_cap
-- One frequency cap of snapshot_policy (N contacts within the cap's window, as lifecycle.eligible_cap).
or count(*) filter (where (c.status = 'sent' and c.sent_at >= {since}) or c.status = 'sending'
                            or (c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at)
                                < greatest({until}::timestamptz, now() + {window}::interval))) >= {emails}

-- name: snapshot_analyze
-- Statistics of the filled snapshot (a temporary table has none), so the planner of
-- snapshot_policy knows how many candidates it joins.
analyze {snapshot}

-- name: snapshot_page
-- The next page of the snapshot in user_id order (keyset on its primary key: ~1 ms a page at any
-- audience size). The contact guard re-checks every user of the page at mint.
select user_id, email, context from {snapshot}
where user_id > %(after)s
order by user_id
limit %(limit)s

-- name: snapshot_drop
-- The campaign is done: drop its snapshot.
drop table if exists {snapshot}

-- name: audience_count
-- Size of the eligible audience, for the run summary and dry runs.
select count(*) from (
{eligible}
) as e

-- name: audience_ids
-- The eligible audience's user ids (the dry run: store.preview takes out, in priority order, the
-- users an earlier campaign of the run would claim).
select e.user_id from (
{eligible}
) as e

-- name: mint
-- Mint one chunk as claimed ('sending') rows, under the contact guard (the caller holds the users'
-- mail.contact locks, has re-checked the policy and holds the addresses). ON CONFLICT DO NOTHING on
-- the live (user, campaign) key: the claimed set is exactly the rows RETURNING gives back (a
-- concurrent run's row is never sent twice). The 'minted' event is appended in the same statement.
with minted as (
    insert into mail.send_log (user_id, campaign, kind, email, email_key, context, status, claimed_at, attempts,
                               dag_id, run_id, task_id, data_interval_start, data_interval_end)
    select p.user_id, %(campaign)s, 'lifecycle', p.email, p.email_key, p.context, 'sending', now(), 1,
           %(dag_id)s, %(run_id)s, %(task_id)s, %(interval_start)s, %(interval_end)s
    from jsonb_to_recordset(%(page)s::jsonb) as p(user_id bigint, email text, email_key text, context jsonb)
    order by p.user_id
    on conflict (user_id, campaign) where released_at is null do nothing
    returning id, user_id, email, context
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, dag_id, run_id, task_id)
    select id, null, 'sending', 1, %(dag_id)s, %(run_id)s, %(task_id)s from minted
)
select id, user_id, email, context from minted order by id

-- name: mint_decided
-- Rows decided locally, never requested: 'failed' (invalid address, the validator's reason) or
-- 'duplicate' (another user of the campaign got it at this address: the reason names them). They
-- keep the live (user, campaign) key, so the user is not selected again for this campaign. The
-- event carries the reason.
with made as (
    insert into mail.send_log (user_id, campaign, kind, email, context, status, error, attempts,
                               dag_id, run_id, task_id, data_interval_start, data_interval_end)
    select p.user_id, %(campaign)s, 'lifecycle', p.email, p.context, p.status, p.error, 0,
           %(dag_id)s, %(run_id)s, %(task_id)s, %(interval_start)s, %(interval_end)s
    from jsonb_to_recordset(%(page)s::jsonb) as p(user_id bigint, email text, context jsonb, status text, error text)
    order by p.user_id
    on conflict (user_id, campaign) where released_at is null do nothing
    returning id, status, error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, null, status, 0, error, %(dag_id)s, %(run_id)s, %(task_id)s from made
returning send_log_id

-- name: reserve_addresses
-- One email per (campaign, normalised address): the first user to claim an address holds it
-- (mail.campaign_address). Keys in sorted order, so concurrent claimers never deadlock on them; a
-- claimer waits for an uncommitted reservation of the same key, then sees its holder.
insert into mail.campaign_address (campaign, email_key, user_id)
select %(campaign)s, r.k, r.u from unnest(%(keys)s::text[], %(uids)s::bigint[]) as r(k, u)
order by r.k, r.u
on conflict (campaign, email_key) do nothing

-- name: address_holders
-- Who holds these normalised addresses for the campaign (the 'duplicate' reason names them).
select email_key, user_id from mail.campaign_address
where campaign = %(campaign)s and email_key = any(%(keys)s::text[])

-- name: rejected_in_run
-- Normalised addresses the provider rejected earlier in this run (any campaign): a lower-priority
-- campaign does not try them again in the same run.
select distinct email_key from mail.send_log
where run_id = %(run_id)s and email_key = any(%(keys)s::text[])
  and status = 'failed' and released_at is null and dead_lettered_at is null and attempts > 0
