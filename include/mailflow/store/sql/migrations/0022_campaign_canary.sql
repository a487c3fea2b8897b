-- 0022: a canary for scheduled campaigns. A campaign may start with a canary share: the first share of its rows
-- in plan order (their id order: provisioning creates a campaign's rows in plan order) is dispatched; the rest is
-- held by the claim statements (the database, not only the dispatcher's Python) until the canary's outcomes are
-- in (canary_min_outcome_share of its sent emails have an outcome, or canary_max_wait passed since its last send)
-- and the reputation guard has not tripped the campaign or the account. Then canary_released_at is set and the
-- rest is dispatched as planned (rows whose time passed meanwhile go out when released). Every column is
-- metadata-only (a constant default or none): no table rewrite.
alter table mail.campaign
    add column if not exists canary_share             numeric,
    add column if not exists canary_min_outcome_share numeric  not null default 0.9,
    add column if not exists canary_max_wait          interval not null default interval '1 hour',
    add column if not exists canary_last_id           bigint,
    add column if not exists canary_released_at       timestamptz;
alter table mail.campaign drop constraint if exists campaign_canary_share_range;
alter table mail.campaign add constraint campaign_canary_share_range
    check (canary_share is null or (canary_share > 0 and canary_share < 1));
alter table mail.campaign drop constraint if exists campaign_canary_outcome_share_range;
alter table mail.campaign add constraint campaign_canary_outcome_share_range
    check (canary_min_outcome_share > 0 and canary_min_outcome_share <= 1);
alter table mail.campaign drop constraint if exists campaign_canary_max_wait_positive;
alter table mail.campaign add constraint campaign_canary_max_wait_positive check (canary_max_wait > interval '0');

comment on column mail.campaign.canary_share is
    'Share (0..1, exclusive) of the campaign''s rows sent first as a canary; null: no canary, everything is '
    'dispatched as planned.';
comment on column mail.campaign.canary_min_outcome_share is
    'The canary is in when this share (0..1] of its sent emails has an outcome (mail.delivery_status.outcome).';
comment on column mail.campaign.canary_max_wait is
    'Or when this long has passed since the canary''s last email was sent, whatever share has an outcome.';
comment on column mail.campaign.canary_last_id is
    'The send-log id of the canary''s last row (rows of the campaign with id <= it are the canary), fixed when '
    'provisioning completes; null until then (with a canary share, nothing is dispatched before it is known).';
comment on column mail.campaign.canary_released_at is
    'When the rest of the campaign was released after the canary (database clock); null: still held.';
