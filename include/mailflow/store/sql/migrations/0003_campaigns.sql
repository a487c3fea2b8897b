-- 0003: scheduled campaigns. A campaign is a plan (timezone, emails per day, weekdays, local
-- windows, start) and a recipient list; each email is one `kind = 'scheduled'` row in
-- mail.send_log with its `scheduled_at` (UTC), so the cooldown and analytics see both kinds.
-- Every timestamp is timestamptz (stored in UTC).

create table mail.campaign (
    id                bigint      generated always as identity primary key,
    name              text        not null unique,          -- = mail.send_log.campaign
    timezone          text        not null default 'Europe/Berlin',   -- IANA key
    emails_per_day    integer     not null default 20 check (emails_per_day >= 1),
    weekdays          integer[]   not null default '{1,2,3,4,5}'       -- ISO: 1 = Monday .. 7 = Sunday
                      check (cardinality(weekdays) >= 1 and weekdays <@ '{1,2,3,4,5,6,7}'),
    windows           text[]      not null default '{09:00-12:00,14:00-17:00}'  -- local 'HH:MM-HH:MM'
                      check (cardinality(windows) >= 1),
    start_at          timestamptz not null default now(),  -- nothing is planned before it
    status            text        not null default 'draft'
                      check (status in ('draft', 'scheduled', 'paused', 'cancelled', 'completed')),
    template          text        not null,                 -- campaigns/templates/<template>.{html,txt}.j2
    subject           text        not null,                 -- Jinja string over `user` (the recipient row)
    from_address      text        not null,
    reply_to          text,
    recipients_sql    text,                                 -- campaigns/recipients/<file>.sql
    recipients_table  text,                                 -- an uploaded list, e.g. mail.campaign_recipient
    marketing         boolean     not null default true,    -- List-Unsubscribe headers (RFC 8058)
    -- provisioning checkpoint, advanced in the same transaction as each chunk of rows
    provisioned_count integer     not null default 0,       -- rows created so far
    provision_cursor  bigint,                               -- last user_id provisioned (keyset)
    provisioned_at    timestamptz,                          -- the recipient list was exhausted
    -- the plan: slot i is the i-th instant of planner.plan_send_times(spec, ., plan_start) after
    -- plan_skip slots; planned_through is the last slot given to a row (null: none yet)
    plan_start        timestamptz,
    plan_skip         integer     not null default 0,
    planned_through   timestamptz,
    created_at        timestamptz not null default now(),
    updated_at        timestamptz not null default now(),
    constraint campaign_one_recipient_source
        check ((recipients_sql is null) <> (recipients_table is null))
);

-- Status changes of campaigns (and provisioning / re-planning milestones), appended in the same
-- transaction as the change.
create table mail.campaign_event (
    id          bigint      generated always as identity primary key,
    campaign_id bigint      not null references mail.campaign (id),
    from_status text,
    to_status   text        not null,
    at          timestamptz not null default now(),
    detail      jsonb       not null default '{}'::jsonb,
    actor       text
);
create index campaign_event_campaign_idx on mail.campaign_event (campaign_id, at);

-- An uploaded recipient list (one of the two recipient sources). Extra template variables go in
-- `context`; they are merged into the row's snapshot at provisioning.
create table mail.campaign_recipient (
    campaign_id bigint not null references mail.campaign (id),
    user_id     bigint not null,
    email       text   not null,
    first_name  text,
    context     jsonb  not null default '{}'::jsonb,
    primary key (campaign_id, user_id)
);

-- The dispatcher: "pending rows due by now, earliest first". With FOR UPDATE SKIP LOCKED the scan
-- walks this index and steps over rows another dispatcher has locked, without waiting for it.
create index send_log_pending_due_idx on mail.send_log (scheduled_at) where status = 'pending';
-- Cancel / resume / completion: a campaign's open rows.
create index send_log_campaign_open_idx on mail.send_log (campaign, scheduled_at)
    where status in ('pending', 'sending');
