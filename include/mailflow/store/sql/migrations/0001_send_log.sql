-- 0001: the send log (one row per email), its event history, prepared batches and the shared
-- provider rate schedule. Every timestamp is timestamptz and stored in UTC.
create schema if not exists mail;

create table mail.send_log (
    id                  bigint generated always as identity primary key,
    user_id             bigint      not null,
    campaign            text        not null,
    kind                text        not null default 'lifecycle' check (kind in ('lifecycle', 'scheduled')),
    email               text        not null,
    context             jsonb       not null default '{}'::jsonb,
    status              text        not null default 'pending'
                        check (status in ('pending', 'sending', 'sent', 'failed', 'cancelled')),
    scheduled_at        timestamptz,
    minted_at           timestamptz not null default now(),
    claimed_at          timestamptz,
    sent_at             timestamptz,
    released_at         timestamptz,
    provider_message_id text,
    idempotency_key     text,
    batch_index         smallint,
    attempts            integer     not null default 0,
    error               text,
    dead_lettered_at    timestamptz,
    dag_id              text,
    run_id              text,
    task_id             text,
    data_interval_start timestamptz,
    data_interval_end   timestamptz,
    constraint send_log_sent_has_provider_id check (status <> 'sent' or provider_message_id is not null),
    constraint send_log_released_is_failed check (released_at is null or status = 'failed')
);

-- One live email per (user, campaign). A row released after a whole-request failure (the email
-- was definitely not sent) leaves this key, so the next run's audience decides again.
create unique index send_log_user_campaign_uq on mail.send_log (user_id, campaign) where released_at is null;
-- Cooldown anti-join: "has this user a live (pending/sending) or recently sent email?"
create index send_log_cooldown_idx on mail.send_log (user_id, sent_at)
    where status in ('pending', 'sending', 'sent');
-- Reconciler and dispatcher scans over the non-terminal states.
create index send_log_open_idx on mail.send_log (status, claimed_at) where status in ('pending', 'sending');
create index send_log_batch_idx on mail.send_log (idempotency_key, batch_index) where idempotency_key is not null;
create unique index send_log_provider_id_uq on mail.send_log (provider_message_id) where provider_message_id is not null;
create index send_log_campaign_minted_idx on mail.send_log (campaign, minted_at);

-- Every state change of a send-log row, appended in the same statement as the change.
create table mail.send_event (
    id                  bigint generated always as identity primary key,
    send_log_id         bigint      not null references mail.send_log (id),
    from_status         text,
    to_status           text        not null,
    at                  timestamptz not null default now(),
    attempt             integer,
    error               text,
    provider_message_id text,
    dag_id              text,
    run_id              text,
    task_id             text
);
create index send_event_send_log_idx on mail.send_event (send_log_id, at);

-- The exact request bytes of each prepared batch, so any retry (in-process or by the reconciler)
-- is byte-identical under the same Idempotency-Key.
create table mail.send_batch (
    idempotency_key text        primary key,
    campaign        text        not null,
    email_count     smallint    not null check (email_count between 1 and 100),
    body            bytea       not null,
    created_at      timestamptz not null default now()
);

-- The provider's request schedule, shared by every process, run and worker that sends.
create table mail.rate_slot (
    account   text        primary key,
    next_slot timestamptz not null
);

-- Addresses or users that must not be emailed (unsubscribes, bounces, complaints).
create table mail.suppression (
    id         bigint generated always as identity primary key,
    user_id    bigint,
    email      text,
    scope      text        not null default 'all',
    source     text        not null,
    reason     text,
    created_at timestamptz not null default now(),
    constraint suppression_has_subject check (user_id is not null or email is not null)
);
create unique index suppression_user_scope_uq on mail.suppression (user_id, scope) where user_id is not null;
create unique index suppression_email_scope_uq on mail.suppression (lower(email), scope) where email is not null;
