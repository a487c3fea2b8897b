-- name: eligible
-- A campaign's audience after the engine's exclusions: the one place every campaign is wrapped.
-- The audience placeholder takes the campaign's own, version-controlled SQL; every value is bound.
-- Exclusions:
--   dedupe:      the user already has a live row for this campaign (unique key send_log_user_campaign_uq);
--   attempts:    max_attempts whole-request failures for this campaign already (a dead letter);
--   cooldown:    any campaign's email within the cooldown on either side of the interval end:
--                sent since cooldown_since (no upper bound, so a backfill also sees what was
--                sent after its interval), in flight ('sending'), or planned ('pending') before
--                cooldown_until (a scheduled email weeks away does not block today's);
--   suppression: the user or the address is suppressed for all mail or for this campaign.
select a.user_id, a.email, to_jsonb(a) - 'user_id' - 'email' as context
from (
{audience}
) as a
where not exists (select 1 from mail.send_log d
                  where d.user_id = a.user_id and d.campaign = %(campaign)s and d.released_at is null)
  and (select count(*) from mail.send_log r
       where r.user_id = a.user_id and r.campaign = %(campaign)s and r.released_at is not null) < %(max_attempts)s
  -- (two probes, each a plain index condition on send_log_cooldown_idx: measurably faster at 1M
  -- users than one probe with a CASE; see docs/performance.md)
  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id
                    and (c.status = 'sending'
                         or (c.status = 'pending'
                             and coalesce(c.scheduled_at, c.minted_at) < %(cooldown_until)s)))
  and not exists (select 1 from mail.suppression s
                  where s.user_id = a.user_id and s.scope in ('all', %(campaign)s))
  and not exists (select 1 from mail.suppression s
                  where lower(s.email) = lower(a.email) and s.scope in ('all', %(campaign)s))

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

-- name: audience_count
-- Size of the eligible audience, for the run summary and dry runs.
select count(*) from (
{eligible}
) as e

-- name: mint
-- Mint one chunk as claimed ('sending') rows. ON CONFLICT DO NOTHING on the live unique key:
-- the claimed set is exactly the rows RETURNING gives back (a concurrent run's row is never
-- sent twice). The 'minted' event is appended in the same statement.
with minted as (
    insert into mail.send_log (user_id, campaign, kind, email, context, status, claimed_at, attempts,
                               dag_id, run_id, task_id, data_interval_start, data_interval_end)
    select p.user_id, %(campaign)s, 'lifecycle', p.email, p.context, 'sending', now(), 1,
           %(dag_id)s, %(run_id)s, %(task_id)s, %(interval_start)s, %(interval_end)s
    from jsonb_to_recordset(%(page)s::jsonb) as p(user_id bigint, email text, context jsonb)
    order by p.user_id
    on conflict (user_id, campaign) where released_at is null do nothing
    returning id, user_id, email, context
), ev as (
    insert into mail.send_event (send_log_id, from_status, to_status, attempt, dag_id, run_id, task_id)
    select id, null, 'sending', 1, %(dag_id)s, %(run_id)s, %(task_id)s from minted
)
select id, user_id, email, context from minted order by id
