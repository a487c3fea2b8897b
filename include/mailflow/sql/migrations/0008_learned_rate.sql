-- migrate: no-transaction
-- 0008 (issue 16): the provider's learned rate limit lives with the shared slot schedule, so every process
-- and worker starts from what the provider said, not from its connection's default.
-- Run statement by statement outside a transaction (mailflow.migrate), for the CONCURRENTLY index
-- at the end; every statement is idempotent, so an interrupted run is resumed by the next one.
-- ADD COLUMN with constant defaults: no table rewrite, a brief lock on the small mail.rate_slot.
alter table mail.rate_slot
    add column if not exists limit_per_second     double precision check (limit_per_second > 0),
    add column if not exists limit_seen_at        timestamptz,
    add column if not exists penalty              double precision not null default 0
        check (penalty >= 0 and penalty <= 0.5),
    add column if not exists penalty_at           timestamptz,
    add column if not exists rate_limited_total   bigint not null default 0,
    add column if not exists last_rate_limited_at timestamptz,
    add column if not exists spacing              double precision check (spacing > 0);

comment on column mail.rate_slot.limit_per_second is
    'The provider''s last observed ratelimit-limit header (requests per second, per team), learned from any '
    'response on this account; null until a response carried it. Senders pace at '
    'least(configured requests_per_second, this) x target_fraction x (1 - decayed penalty).';
comment on column mail.rate_slot.limit_seen_at is 'When limit_per_second was last written (database clock).';
comment on column mail.rate_slot.penalty is
    'Share (0-0.5) by which a 429 rate_limit_exceeded lowered the shared rate: +0.1 per 429, decaying '
    'linearly to 0 over 600 s from penalty_at.';
comment on column mail.rate_slot.penalty_at is 'When penalty was last raised by a 429 (database clock).';
comment on column mail.rate_slot.rate_limited_total is 'How many 429 rate_limit_exceeded answers any sender of this account received.';
comment on column mail.rate_slot.last_rate_limited_at is 'The latest 429 rate_limit_exceeded on this account (database clock).';
comment on column mail.rate_slot.spacing is
    'Seconds between request starts used by the latest claim: 1 / (effective requests per second).';

-- Released rows not yet dead-lettered, by release time: reconcile's dead_letter_exhausted examines
-- only the pairs released in the last day (index-only) instead of grouping every released row of
-- the send log on every run. Small: released rows are ~2% of the log, and a row leaves the index
-- when it is dead-lettered; it is written only when a row is released or dead-lettered.
create index concurrently if not exists send_log_released_at_idx on mail.send_log (released_at) include (user_id, campaign)
    where released_at is not null and dead_lettered_at is null;
