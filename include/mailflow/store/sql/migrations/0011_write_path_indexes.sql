-- migrate: no-transaction
-- 0011 (each index costs WAL on every apply): the write path keeps only the analytics indexes that earn their cost.
-- Run statement by statement outside a transaction (mailflow.migrate): the view first, so every
-- reader it serves has it before the index goes; DROP INDEX CONCURRENTLY waits for the transactions
-- using the index and blocks no reader or writer of mail.send_log.
--
-- Measured per chunk of 100 emails (python -m bench.write_path; docs/performance.md, "Write path"):
-- every mint INSERTs each row into every index whose predicate it meets, every apply (sending ->
-- sent, not a HOT update) does it again. Of 0004's seven indexes (0009):
--
-- * send_log_sent_idx (sent_at) INCLUDE (user_id, campaign) WHERE status = 'sent': dropped. The
--   largest per-apply cost of them (~12-13 kB of WAL per apply, 221 MB at 5M rows) for entries that
--   send_log_campaign_sent_idx holds too (same rows, keyed by campaign first). Its readers (docs Q1
--   and Q10, the progress page's send charts, the deliverability poll's window) read the new view
--   mail.sent_email below instead: one range of send_log_campaign_sent_idx per campaign (the
--   send log has a handful of campaign names), index-only where the columns allow. The dry-run
--   count and preview (lifecycle.eligible_policy / eligible_cap) read send_log_contact_idx instead
--   (0010), measured as fast at 1M users.
-- * kept: send_log_campaign_minted_cover_idx, send_log_campaign_sent_idx (the counting views:
--   index-only per campaign), send_log_failed_idx and send_log_cancelled_idx (partial on states the
--   hot path rarely writes: ~0 per chunk), send_log_user_idx (the only index with every row of a
--   user: a user's history, mail.email_status by user, docs Q3; ~6-7 kB per mint and per apply) and
--   send_log_run_idx (the only way to a run's rows: docs Q3 and Q4, and the engine's once-per-run
--   load of the run's rejected addresses, mint.rejected_of_run, a 0.5 s Seq Scan at 5M rows
--   without it; ~10 kB per mint and per apply).

-- Sent emails, by time: the rows of send_log_sent_idx, found per campaign. The campaign names come
-- from a skip scan of send_log_campaign_sent_idx (one probe per name); unnest() of their array is
-- estimated at a few rows, so the planner joins each name to its own index range of
-- send_log_campaign_sent_idx (a recursive CTE joined directly is estimated at ~100 rows and loses to
-- a whole-index scan).
create or replace view mail.sent_email as
select l.id                  as send_log_id,
       l.campaign,
       l.kind,
       l.user_id,
       l.email,
       l.sent_at,
       l.provider_message_id
from unnest(array(
        with recursive seen (campaign) as (
            (select x.campaign from mail.send_log x where x.status = 'sent' order by x.campaign limit 1)
            union all
            select (select x.campaign from mail.send_log x
                    where x.status = 'sent' and x.campaign > s.campaign order by x.campaign limit 1)
            from seen s
            where s.campaign is not null)
        select s.campaign from seen s where s.campaign is not null)) as c (campaign)
join mail.send_log l on l.campaign = c.campaign and l.status = 'sent';

comment on view mail.sent_email is
    'One row per sent email (status sent). Filter by sent_at (and campaign): each campaign is then '
    'one index range. mail.send_log has no index on sent_at alone since 0011. See docs/send_log.md.';
comment on column mail.sent_email.send_log_id is 'The email (mail.send_log.id; the X-Mailflow-Send-Id header).';
comment on column mail.sent_email.campaign is 'Campaign name (lifecycle or scheduled).';
comment on column mail.sent_email.kind is 'lifecycle or scheduled.';
comment on column mail.sent_email.user_id is 'Recipient (app.users.user_id).';
comment on column mail.sent_email.email is 'Recipient address as snapshotted when the row was minted.';
comment on column mail.sent_email.sent_at is 'When the provider accepted the email (timestamptz, UTC).';
comment on column mail.sent_email.provider_message_id is 'The provider''s email id (Resend id).';

drop index concurrently if exists mail.send_log_sent_idx;
