-- name: eligible
-- A campaign's audience after the engine's exclusions: the one place every campaign is wrapped.
-- The audience placeholder takes the campaign's own, version-controlled SQL; every value is bound.
-- Exclusions (each a top-level NOT EXISTS, so the planner turns every one into an anti-join and
-- can hash a whole set once instead of probing per candidate; docs/performance.md):
--   dedupe:      the user already has a live row for this campaign (unique key send_log_campaign_user_uq,
--                0012: a campaign's users are one range of it, read once and hashed for a large audience),
--                a 'holdout' row included (the user was decided: held out);
--   (no attempts clause: a whole-request failure never charges a user; only a rejection of that
--    exact email or an unknown outcome past the idempotency window excludes one, and both keep
--    the live unique key, so `dedupe` covers them; docs/model.md)
--   policy:      the contact policy pre-filter (lifecycle.eligible_policy: cooldown and one
--                lifecycle.eligible_cap per frequency cap the cooldown does not imply; for the run's
--                snapshot the same rules as one probe per candidate, lifecycle.snapshot_policy);
--                empty for an exempt campaign (transactional mail, `policy = "exempt"`); it reads pending,
--                sending and sent rows only: a 'holdout' row (or any other terminal state) is no contact;
--   suppression: the user or the address is suppressed for all mail or for this campaign. The
--                address part is a pre-filter on the stored mailbox key (suppression.email_key):
--                the audience's address trimmed and its ASCII letters lower-cased by translate()
--                (locale-independent; exact for an ASCII address, whose mailbox key is just that).
--                A non-ASCII spelling is not matched here but at mint, on the key computed in
--                Python (mailflow.store.policy.mailbox_key): held there, never sent.
-- Composed by store.eligible_sql: the select list is user_id, email and the context (every other
-- column of the audience, as JSON) for counts, dry runs and live pages, or the audience's own
-- columns for the snapshot (which builds the context per page, lifecycle.snapshot_page); the join
-- after the audience is the snapshot's policy probe, else empty.
-- This is the pre-filter (the audience snapshot); the authoritative check is repeated per user at
-- mint, under the contact guard (store.mint_chunk).
select {columns}
from (
{audience}
) as a
{policy_join}
where not exists (select 1 from mail.send_log d
                  where d.user_id = a.user_id and d.campaign = %(campaign)s and d.released_at is null)
  {policy}
  and not exists (select 1 from mail.suppression s
                  where s.user_id = a.user_id and s.scope in ('all', %(campaign)s))
  and not exists (select 1 from mail.suppression s
                  where s.email_key is not null
                    and s.email_key = translate(btrim(a.email, E' \t\r\n'), 'ABCDEFGHIJKLMNOPQRSTUVWXYZ',
                                                'abcdefghijklmnopqrstuvwxyz')
                    and s.scope in ('all', %(campaign)s))

-- name: eligible_policy
-- The cooldown part of lifecycle.eligible (composed in unless the campaign is exempt): any
-- campaign's email within the cooldown of the email's decision: sent since cooldown_since =
-- interval end - cooldown (no upper bound, so a backfill also sees what was sent after its
-- interval), in flight ('sending'), or planned ('pending') before cooldown_until = greatest(interval
-- end, now()) + cooldown: measured from the ACTUAL send time (now), so a backfill never sends inside
-- a planned email's cooldown; a planned email of a paused, cancelled or completed campaign does not
-- count (see contact.contacts_of; 0017 put the campaign into the contact index for it). Two
-- anti-joins over the users' contacts (send_log_contact_idx; 0011 dropped the send_log_sent_idx
-- these once read as one range), then the caps.
and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status in ('pending', 'sending')
                    and (c.status = 'sending'
                         or (coalesce(c.scheduled_at, c.minted_at)
                             < greatest(%(cooldown_until)s::timestamptz, now() + %(cooldown)s::interval)
                             and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed')))))
  {caps}

-- name: eligible_cap
-- One frequency cap (N emails per window W) the cooldown does not imply, set-based: the users with
-- at least N contacts within W of the email (sent since cap_since, in flight, or planned before
-- greatest(cap_until, now() + W)), counted once over index ranges (send_log_campaign_sent_idx or
-- send_log_contact_idx since 0011, send_log_open_idx) and grouped, then anti-joined. A correlated count per candidate cost ~10 us
-- each, i.e. seconds for a large audience (docs/performance.md).
and not exists (
      select 1 from (
          select x.user_id from (
              select c.user_id from mail.send_log c where c.status = 'sent' and c.sent_at >= {since}
              union all
              select c.user_id from mail.send_log c
              where c.status in ('pending', 'sending')
                and (c.status = 'sending'
                     or (coalesce(c.scheduled_at, c.minted_at) < greatest({until}::timestamptz, now() + {window}::interval)
                         and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed'))))
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
-- The run's audience snapshot of one campaign, evaluated ONCE for this run: a temporary
-- table of this session with the audience's own columns (lifecycle.eligible composed with a.*:
-- dedupe, suppression and the contact policy in the one statement), dropped when the campaign ends
-- (or with the session). The table's name is generated; snapshot_key then makes user_id its key.
-- Only the survivors are written, and as plain rows: the JSON context of a user is built when a page
-- reads them (snapshot_page), so ~1,000 a run instead of one per candidate (docs/performance.md).
create temp table {snapshot} on commit preserve rows as
{eligible}

-- name: snapshot_policy
-- The contact-policy pre-filter of lifecycle.eligible_policy / eligible_cap (same rules, same
-- rows) as one probe of each candidate's contacts (send_log_contact_idx, index-only), after the
-- anti-joins: a row (held) if the user has an email in flight, one sent since cooldown_since, one
-- planned before greatest(cooldown_until, now() + cooldown), or at least N contacts within a
-- frequency cap's window (snapshot_cap); lifecycle.eligible keeps the users without one
-- (`p.held is null`). Sent emails older than the earliest window (contact_since: cooldown_since or
-- a cap's since, the least) count in no rule, so they are not aggregated. Not composed for an
-- exempt campaign.
left join lateral (
    select true as held
    from mail.send_log c
    where c.user_id = a.user_id and c.status in ('pending', 'sending', 'sent')
      and (c.status <> 'sent' or c.sent_at >= {contact_since})
    having bool_or(c.status = 'sending')
        or bool_or(c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
        or bool_or(c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at)
                                             < greatest(%(cooldown_until)s::timestamptz, now() + %(cooldown)s::interval)
                   and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed')))
        {caps}
) as p on true

-- name: snapshot_cap
-- One frequency cap of snapshot_policy (N contacts within the cap's window, as lifecycle.eligible_cap).
or count(*) filter (where (c.status = 'sent' and c.sent_at >= {since}) or c.status = 'sending'
                            or (c.status = 'pending' and coalesce(c.scheduled_at, c.minted_at)
                                < greatest({until}::timestamptz, now() + {window}::interval)
                                and c.campaign not in (select k.name from mail.campaign k where k.status in ('paused', 'cancelled', 'completed')))) >= {emails}

-- name: snapshot_key
-- The snapshot's key, built once after the fill (a sort of the survivors; cheaper than checking
-- each inserted row against an index). Fails if the audience file lists a user twice: snapshot_dedupe.
alter table {snapshot} add primary key (user_id)

-- name: snapshot_dedupe
-- A user listed twice by an audience file counts once: the first row the fill wrote stays (as an
-- INSERT ... ON CONFLICT DO NOTHING keeps it), the others go; then snapshot_key again.
delete from {snapshot} t
using {snapshot} o
where o.user_id = t.user_id and o.ctid < t.ctid

-- name: send_log_stats_stale
-- Whether mail.send_log changed by more than half its analysed size (plus 1,000 rows) since its last
-- ANALYZE, or was never analysed: then the planner's row counts for it are wrong, and the snapshot
-- plans defensively (store.open_audience). Reads two catalog rows.
select coalesce(s.n_mod_since_analyze > greatest(c.reltuples, 0) * 0.5 + 1000, true)
from pg_class c left join pg_stat_user_tables s on s.relid = c.oid
where c.oid = 'mail.send_log'::regclass

-- name: snapshot_page
-- The next page of the snapshot in user_id order (keyset on its primary key: ~1 ms a page at any
-- audience size), with each user's context built as lifecycle.eligible builds it (every column of
-- the audience but user_id and email, as JSON). The contact guard re-checks every user of the page
-- at mint.
select t.user_id, t.email, to_jsonb(t) - 'user_id' - 'email' as context from {snapshot} t
where t.user_id > %(after)s
order by t.user_id
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
-- (The mint before ids were allocated first (mint.allocate), kept as the "before" of python -m bench.write_path --mint assign: rows
-- INSERTed without their key, then send_log.assign_batch UPDATEs each; the engine uses mint.mint_keyed.)
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
-- Rows decided locally, never requested: 'failed' (invalid address, the validator's reason),
-- 'duplicate' (another user of the campaign got it at this address: the reason names them) or
-- 'holdout' (the user is in the campaign's holdout group: no reason, never sent, not a contact).
-- They keep the live (user, campaign) key, so the user is not selected again for this campaign. The
-- event carries the reason.
with made as (
    insert into mail.send_log (user_id, campaign, kind, email, email_key, context, status, error, attempts,
                               dag_id, run_id, task_id, data_interval_start, data_interval_end)
    select p.user_id, %(campaign)s, 'lifecycle', p.email, p.email_key, p.context, p.status, p.error, 0,
           %(dag_id)s, %(run_id)s, %(task_id)s, %(interval_start)s, %(interval_end)s
    from jsonb_to_recordset(%(page)s::jsonb)
         as p(user_id bigint, email text, email_key text, context jsonb, status text, error text)
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
