-- migrate: no-transaction
-- 0009: the analytics indexes of 0004, built CONCURRENTLY (no lock that blocks reads or writes of
-- mail.send_log; each build waits for the transactions open when it starts). Run by the migrator
-- statement by statement outside a transaction; an interrupted build leaves an INVALID index that
-- the next run drops and rebuilds (mailflow.migrate). A database that ran the old 0004 (which built
-- them in one transaction) already has them: only the covering (campaign, minted_at) index is
-- built once more, under its new name.
--
-- The views read a campaign's rows through narrow indexes that hold every column they need, so a
-- large campaign is counted by index-only scans (never a scan of the whole table). Index-only scans
-- rely on the visibility map that autovacuum maintains.

-- 0001's (campaign, minted_at) index, replaced by one with the columns the daily view needs.
create index concurrently if not exists send_log_campaign_minted_cover_idx on mail.send_log (campaign, minted_at)
    include (user_id, kind);
drop index concurrently if exists mail.send_log_campaign_minted_idx;
-- Sent emails by campaign: counts, the send rate (last 5 minutes), the latest sends, days.
create index concurrently if not exists send_log_campaign_sent_idx on mail.send_log (campaign, sent_at)
    include (user_id, kind) where status = 'sent';
-- Sent emails by time: "who got an email on day X?", emails per user in a period.
create index concurrently if not exists send_log_sent_idx on mail.send_log (sent_at) include (user_id, campaign)
    where status = 'sent';
-- Failed emails (a small share) by campaign and by time: rejections, rolled-back attempts, dead letters.
create index concurrently if not exists send_log_failed_idx on mail.send_log (campaign, minted_at)
    include (user_id, kind, claimed_at, released_at, dead_lettered_at) where status = 'failed';
-- Cancelled emails (a small share) by campaign.
create index concurrently if not exists send_log_cancelled_idx on mail.send_log (campaign, minted_at)
    include (user_id, kind) where status = 'cancelled';
-- A user's history (mail.user_email_history) and the cooldown re-evaluation of one run: every row
-- of a user, live or released (the other user_id indexes are partial).
create index concurrently if not exists send_log_user_idx on mail.send_log (user_id);
-- "What did run R do?": the rows one Airflow run minted or claimed, by campaign.
create index concurrently if not exists send_log_run_idx on mail.send_log (run_id, campaign)
    where run_id is not null;
