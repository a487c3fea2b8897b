-- 0002: what the reconciler needs: find released attempts of a (user, campaign) quickly, and find
-- stale claims and dead letters by time.
create index send_log_released_idx on mail.send_log (user_id, campaign) where released_at is not null;
create index send_log_dead_letter_idx on mail.send_log (dead_lettered_at) where dead_lettered_at is not null;
create index send_batch_created_idx on mail.send_batch (created_at);
