-- 0008: the provider's learned rate limit lives with the shared slot schedule, so every process
-- and worker starts from what the provider said, not from its connection's default.
-- One transaction. ADD COLUMN with constant defaults: no table rewrite, a brief lock on the small
-- mail.rate_slot. (A partial index for the reconciler's dead-letter sweep was here briefly; the sweep
-- was removed (a whole-request failure no longer dead-letters anyone), so the index went too. A database that applied that version of 0008 can
-- drop it: drop index concurrently if exists mail.send_log_released_at_idx.)
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

