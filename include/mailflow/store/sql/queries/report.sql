-- name: campaign_tally
-- Every campaign's emails by the columns every summary shows (mailflow.model.tally.COLUMNS, in that
-- order): mail.campaign_progress, one index-only count per state and campaign. Campaigns without a row
-- (a scheduled campaign not provisioned yet) are left out. No parameters.
select campaign, total, pending, sending, sent, failed, cancelled, duplicate, skipped, invalid, dead_lettered,
       rolled_back
from mail.campaign_progress
where total > 0 or rolled_back > 0
order by campaign
