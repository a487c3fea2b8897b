-- name: campaign_tally
-- Every campaign's emails by the columns every summary shows (mailflow.model.tally.COLUMNS, in that
-- order): mail.campaign_progress, one index-only count per state and campaign. Campaigns without a row
-- (a scheduled campaign not provisioned yet) are left out. No parameters.
select campaign, total, pending, sending, sent, failed, cancelled, duplicate, skipped, holdout, invalid,
       dead_lettered, rolled_back
from mail.campaign_progress
where total > 0 or rolled_back > 0
order by campaign

-- name: campaign_outcomes
-- Every campaign's sent emails and what the provider reported about them since (the columns of
-- mailflow.cli.OUTCOMES_HEAD, in that order): mail.campaign_outcomes, whole history, rates as fractions
-- 0..1 of sent. One index range of send_log_campaign_sent_idx per campaign. No parameters.
select campaign, sent, delivered, hard_bounced, soft_bounced, complained, failed_after_send, unique_opens,
       unique_clicks, no_outcome_yet, delivered_rate, hard_bounce_rate, complaint_rate, open_rate, click_rate
from mail.campaign_outcomes
where sent > 0
order by campaign

-- name: feedback_suppressions_since
-- Mailboxes the provider's reports suppressed (hard bounce, complaint, the provider's own list) since
-- %(since)s, by source: a suppression is one row per mailbox and scope, created once (a later, stronger
-- report changes its source, not its creation time). A scan of mail.suppression, which holds one row per
-- suppressed mailbox or user: small next to the send log.
select source, count(*)::int
from mail.suppression
where created_at >= %(since)s and source in ('bounce', 'complaint', 'provider_suppressed')
group by source
order by source

-- name: webhook_backlog
-- Stored webhook events not applied to the send log yet (their email id is not known yet, or the
-- applier has not reached them): what a reader of the outcomes would still miss. The partial index of
-- unapplied events keeps it small.
select count(*)::int from mail.webhook_event where applied_at is null

-- name: webhooks_stored
-- How many of the given svix ids (text[]) mail.webhook_event holds: an id the provider saw acknowledged
-- and the table lacks is an acknowledged event that was lost. One primary-key probe per id.
select count(*)::int from mail.webhook_event where svix_id = any(%(svix_ids)s::text[])
