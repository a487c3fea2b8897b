-- migrate: no-transaction
-- 0012 (the audience snapshot probes one campaign at a time): the live (user, campaign) key of 0001, send_log_user_campaign_uq
-- (user_id, campaign) WHERE released_at IS NULL, keyed by campaign first instead: the same unique
-- rule on the same rows, so every INSERT ... ON CONFLICT (user_id, campaign) WHERE released_at IS NULL
-- infers it as its arbiter (inference matches the set of columns, not their order) and a lookup of
-- given users of one campaign (campaign = X AND user_id = ANY(...)) is the same index-only probe. What
-- changes: the users who already have a live row of ONE campaign are one contiguous range, so the
-- audience snapshot's dedupe anti-join reads that range once (~0.3M entries per lifecycle campaign at
-- 1M users, ~30 ms) and hashes it, instead of probing the key per candidate or scanning the whole key
-- (~5M entries). The write path keeps the same number of indexes. Built CONCURRENTLY (no lock that
-- blocks reads or writes of mail.send_log; an interrupted build leaves an INVALID index that the next
-- run drops and rebuilds, mailflow.migrate); the old key is dropped once the new one is valid (while
-- both exist both are enforced).
create unique index concurrently if not exists send_log_campaign_user_uq on mail.send_log (campaign, user_id)
    where released_at is null;
drop index concurrently if exists mail.send_log_user_campaign_uq;
