-- Demo copy of the practice platform's application schema ("app").
--
-- The lifecycle audiences (include/mailflow/campaigns/audiences/*.sql) read only
-- these two tables.  In production the schema belongs to the product database;
-- this file exists so the demo, the tests and the benchmarks can stand up an
-- equivalent one.  Every statement is idempotent (IF NOT EXISTS / IF EXISTS), so
-- running it on an existing schema is a no-op (or replaces an index of an earlier
-- version by its covering successor).
--
-- Times are timestamptz (stored as UTC instants).  users.timezone is an IANA
-- zone name (e.g. Europe/Berlin) for local-time rendering/scheduling only.

create schema if not exists app;

create table if not exists app.users (
    user_id        bigint      primary key,
    email          text        not null,          -- as typed by the user: not validated
    first_name     text,                          -- may be null or empty
    last_name      text,
    signed_up_at   timestamptz not null,
    timezone       text        not null,          -- IANA name
    plan           text        not null check (plan in ('free', 'pro')),  -- current plan
    last_active_at timestamptz                    -- null: never came back after sign-up
);

create table if not exists app.assessments (
    assessment_id bigint      primary key,
    user_id       bigint      not null references app.users (user_id),
    kind          text        not null,           -- numerical, verbal, logical, diagrammatic, ...
    is_free       boolean     not null,           -- free test (true) or pro-only test (false)
    started_at    timestamptz not null,
    finished_at   timestamptz,                    -- null: abandoned or still in progress
    score         int,                            -- 0..100, null unless finished
    check (finished_at is null or finished_at >= started_at)
);

-- One account per address (case-insensitive), as the product enforces.
create unique index if not exists users_email_lower_key on app.users (lower(email));
-- first_practice: signed up in the window.
create index if not exists users_signed_up_at_idx on app.users (signed_up_at);
-- practice_tips: active in the window.
create index if not exists users_last_active_at_idx on app.users (last_active_at);
-- finish_assessment / practice_tips: assessments started in the window, with every column those
-- two audience files read (INCLUDE), so the window is one index-only range on a vacuumed table
-- instead of a heap visit per assessment: a requirement of those files (docs/performance.md,
-- "Audience snapshot"). It replaces the plain (started_at) index of earlier versions (same key).
create index if not exists assessments_started_at_cover_idx
    on app.assessments (started_at) include (user_id, assessment_id, kind, finished_at);
drop index if exists app.assessments_started_at_idx;
-- upgrade_offer: free tests finished in the window, with the columns it reads (same reason; it
-- replaces the plain partial (finished_at) index).
create index if not exists assessments_finished_at_free_cover_idx
    on app.assessments (finished_at) include (user_id, score) where is_free;
drop index if exists app.assessments_finished_at_free_idx;
-- per-user lookups (first_practice "never started", the engine's joins, FK) and the lift's conversion probe
-- (docs/send_log.md Q15: an assessment finished in a user's window), which reads finished_at from the index
-- (INCLUDE): one index-only probe per user counted instead of a heap visit per assessment. It replaces the
-- plain (user_id, started_at) index of earlier versions (same key).
create index if not exists assessments_user_id_started_at_cover_idx
    on app.assessments (user_id, started_at) include (finished_at);
drop index if exists app.assessments_user_id_started_at_idx;
