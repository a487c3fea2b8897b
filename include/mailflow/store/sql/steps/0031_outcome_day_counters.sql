-- 0031, step install_outcome_day_counters (run by mailflow.store.backfill in ONE transaction, with a short
-- lock_timeout, retried; a no-transaction migration cannot hold the $$ bodies below).
--
-- Per-campaign, per-day counters of the sent emails and their outcomes, so mail.campaign_outcomes_daily (Q12)
-- and mail.campaign_outcomes read a few hundred counter rows instead of every sent email of the campaign and
-- its delivery_status row (~1.5-3 s for one campaign of 565,000 sent emails at 20M send-log rows).
-- The same design as 0028's counters, with a day:
--
-- * mail.campaign_day_counter (campaign, day, kind, key, n): folded counts. day = the local date of the
--   email's sent_at in the scheduled campaign's timezone (mail.campaign.timezone when the email was sent),
--   UTC otherwise: the day mail.campaign_outcomes_daily counts it on. Keys: sent (rows with status sent), and
--   the outcome keys of mail.delivery_status_counter_keys (0028) of each sent email's delivery_status row:
--   delivered, hard_bounced, soft_bounced, complained, failed_after_send, suppressed, unique_opens,
--   unique_clicks, with_outcome.
-- * mail.campaign_day_counter_delta: the net change per (campaign, day, kind, key) of each statement that
--   changed one, appended by STATEMENT-level triggers on mail.send_log and mail.delivery_status in the
--   writer's own transaction (a change and its delta commit or roll back together; no row lock is shared
--   between writers: they only append).
-- * mail.fold_campaign_day_counters(): moves the visible deltas into the counters (DELETE ... RETURNING), so
--   two folds at once count nothing twice; the first call seeds the counters with one full count (one
--   statement, one snapshot). mailflow.store.counters.fold calls it with the 0028 fold (the reconcile DAG).
-- * mail.campaign_day_counter_state: seeded_at null until that first count, which the migration runs after
--   this step (an empty send log is seeded here); then mail.campaign_outcomes_daily reads the counters.
--
-- A sent email's day never moves: sent is terminal and sent_at is written once, and a campaign's timezone can
-- only change while it is a draft (before it has rows). Rows are never deleted by mailflow; a DELETE of
-- send-log rows with outcomes is not reflected in the outcome keys (the delivery_status rows go first, and
-- their trigger finds the send-log row to name the campaign, as 0028's does); TRUNCATE empties the counters.

create table if not exists mail.campaign_day_counter (
    campaign text   not null,
    day      date   not null,
    kind     text   not null,
    key      text   not null,
    n        bigint not null,
    primary key (campaign, day, kind, key)
);

create table if not exists mail.campaign_day_counter_delta (
    campaign text   not null,
    day      date   not null,
    kind     text   not null,
    key      text   not null,
    n        bigint not null
);
alter table mail.campaign_day_counter_delta set (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

create table if not exists mail.campaign_day_counter_state (
    singleton  boolean     primary key default true check (singleton),
    seeded_at  timestamptz,
    folded_at  timestamptz,
    folded     bigint      not null default 0
);
insert into mail.campaign_day_counter_state default values on conflict do nothing;

-- The day a sent email counts on (mail.campaign_outcomes_daily): the local date of sent_at in the zone.
create or replace function mail.sent_day(sent_at timestamptz, timezone text) returns date
    language sql immutable strict parallel safe
    return (sent_at at time zone timezone)::date;

create or replace function mail.count_send_log_days() returns trigger language plpgsql as $$
begin
    if tg_op = 'INSERT' then
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select r.campaign, mail.sent_day(r.sent_at, coalesce(c.timezone, 'UTC')), r.kind, 'sent', count(*)
        from new_rows r
        left join mail.campaign c on r.kind = 'scheduled' and c.name = r.campaign
        where r.status = 'sent' and r.sent_at is not null
        group by 1, 2, 3;
    elsif tg_op = 'UPDATE' then
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select x.campaign, mail.sent_day(x.sent_at, coalesce(c.timezone, 'UTC')), x.kind, 'sent', sum(x.n)
        from (select r.campaign, r.kind, r.sent_at, 1 as n from new_rows r
              where r.status = 'sent' and r.sent_at is not null
              union all
              select r.campaign, r.kind, r.sent_at, -1 from old_rows r
              where r.status = 'sent' and r.sent_at is not null) as x
        left join mail.campaign c on x.kind = 'scheduled' and c.name = x.campaign
        group by 1, 2, 3
        having sum(x.n) <> 0;
    else
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select r.campaign, mail.sent_day(r.sent_at, coalesce(c.timezone, 'UTC')), r.kind, 'sent', -count(*)
        from old_rows r
        left join mail.campaign c on r.kind = 'scheduled' and c.name = r.campaign
        where r.status = 'sent' and r.sent_at is not null
        group by 1, 2, 3;
    end if;
    return null;
end $$;

-- delivery_status rows name their email: one primary-key probe of mail.send_log each (campaign, kind, sent_at).
create or replace function mail.count_delivery_status_days() returns trigger language plpgsql as $$
begin
    if tg_op = 'INSERT' then
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select l.campaign, mail.sent_day(l.sent_at, coalesce(c.timezone, 'UTC')), l.kind, k.key, count(*)
        from new_rows r
        join mail.send_log l on l.id = r.send_log_id and l.status = 'sent' and l.sent_at is not null
        left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
        cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at, r.soft_bounced_at,
                          r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at, r.first_clicked_at,
                          r.outcome)) as k(key)
        group by 1, 2, 3, 4;
    elsif tg_op = 'UPDATE' then
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select l.campaign, mail.sent_day(l.sent_at, coalesce(c.timezone, 'UTC')), l.kind, x.key, sum(x.n)
        from (select r.send_log_id, k.key, 1 as n
              from new_rows r
              cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at,
                                r.soft_bounced_at, r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at,
                                r.first_clicked_at, r.outcome)) as k(key)
              union all
              select r.send_log_id, k.key, -1
              from old_rows r
              cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at,
                                r.soft_bounced_at, r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at,
                                r.first_clicked_at, r.outcome)) as k(key)
             ) as x
        join mail.send_log l on l.id = x.send_log_id and l.status = 'sent' and l.sent_at is not null
        left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
        group by 1, 2, 3, 4
        having sum(x.n) <> 0;
    else
        insert into mail.campaign_day_counter_delta (campaign, day, kind, key, n)
        select l.campaign, mail.sent_day(l.sent_at, coalesce(c.timezone, 'UTC')), l.kind, k.key, -count(*)
        from old_rows r
        join mail.send_log l on l.id = r.send_log_id and l.status = 'sent' and l.sent_at is not null
        left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
        cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at, r.soft_bounced_at,
                          r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at, r.first_clicked_at,
                          r.outcome)) as k(key)
        group by 1, 2, 3, 4;
    end if;
    return null;
end $$;

drop trigger if exists send_log_day_count_insert on mail.send_log;
create trigger send_log_day_count_insert after insert on mail.send_log
    referencing new table as new_rows for each statement execute function mail.count_send_log_days();
drop trigger if exists send_log_day_count_update on mail.send_log;
create trigger send_log_day_count_update after update on mail.send_log
    referencing old table as old_rows new table as new_rows for each statement
    execute function mail.count_send_log_days();
drop trigger if exists send_log_day_count_delete on mail.send_log;
create trigger send_log_day_count_delete after delete on mail.send_log
    referencing old table as old_rows for each statement execute function mail.count_send_log_days();
drop trigger if exists delivery_status_day_count_insert on mail.delivery_status;
create trigger delivery_status_day_count_insert after insert on mail.delivery_status
    referencing new table as new_rows for each statement execute function mail.count_delivery_status_days();
drop trigger if exists delivery_status_day_count_update on mail.delivery_status;
create trigger delivery_status_day_count_update after update on mail.delivery_status
    referencing old table as old_rows new table as new_rows for each statement
    execute function mail.count_delivery_status_days();
drop trigger if exists delivery_status_day_count_delete on mail.delivery_status;
create trigger delivery_status_day_count_delete after delete on mail.delivery_status
    referencing old table as old_rows for each statement execute function mail.count_delivery_status_days();

create or replace function mail.count_send_log_days_truncate() returns trigger language plpgsql as $$
begin
    delete from mail.campaign_day_counter;
    delete from mail.campaign_day_counter_delta;
    return null;
end $$;
drop trigger if exists send_log_day_count_truncate on mail.send_log;
create trigger send_log_day_count_truncate after truncate on mail.send_log
    for each statement execute function mail.count_send_log_days_truncate();

-- An empty send log is seeded as it stands (no writer can add a row before this transaction commits: the
-- CREATE TRIGGER locks above).
update mail.campaign_day_counter_state set seeded_at = now(), folded_at = now()
where seeded_at is null and not exists (select 1 from mail.send_log) and not exists (select 1 from mail.delivery_status);

-- Fold the visible deltas into the counters; the first call seeds them (one count of the sent emails and
-- their outcomes). Returns the delta rows folded (the seed: the counter rows written), or null when another
-- fold holds the state row.
create or replace function mail.fold_campaign_day_counters() returns bigint
    language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    seeded timestamptz;
    moved  bigint;
begin
    select s.seeded_at into seeded from mail.campaign_day_counter_state s for update skip locked;
    if not found then
        return null;
    end if;
    if seeded is null then
        -- One statement, one snapshot: the counts as of that snapshot and the deltas it sees deleted.
        with gone as (
            delete from mail.campaign_day_counter_delta returning 1
        ), base as (
            select l.campaign, mail.sent_day(l.sent_at, coalesce(c.timezone, 'UTC')) as day, l.kind, 'sent' as key,
                   count(*) as n
            from mail.send_log l
            left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
            where l.status = 'sent' and l.sent_at is not null
            group by 1, 2, 3
            union all
            select l.campaign, mail.sent_day(l.sent_at, coalesce(c.timezone, 'UTC')), l.kind, k.key, count(*)
            from mail.delivery_status d
            join mail.send_log l on l.id = d.send_log_id and l.status = 'sent' and l.sent_at is not null
            left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
            cross join unnest(mail.delivery_status_counter_keys(d.delivered_at, d.hard_bounced_at, d.soft_bounced_at,
                              d.complained_at, d.failed_at, d.suppressed_at, d.first_opened_at, d.first_clicked_at,
                              d.outcome)) as k(key)
            group by 1, 2, 3, 4
        ), counted as (
            insert into mail.campaign_day_counter (campaign, day, kind, key, n)
            select b.campaign, b.day, b.kind, b.key, b.n from base b
            on conflict (campaign, day, kind, key) do update set n = excluded.n
            returning 1
        )
        select count(*) into moved from counted;
        update mail.campaign_day_counter_state set seeded_at = now(), folded_at = now(), folded = folded + moved;
        return moved;
    end if;
    with gone as (
        delete from mail.campaign_day_counter_delta returning campaign, day, kind, key, n
    ), summed as (
        select g.campaign, g.day, g.kind, g.key, sum(g.n) as n, count(*) as rows_
        from gone g group by g.campaign, g.day, g.kind, g.key
    ), upserted as (
        insert into mail.campaign_day_counter as c (campaign, day, kind, key, n)
        select s.campaign, s.day, s.kind, s.key, s.n from summed s
        on conflict (campaign, day, kind, key) do update set n = c.n + excluded.n
    )
    select coalesce(sum(s.rows_), 0) into moved from summed s;
    update mail.campaign_day_counter_state set folded_at = now(), folded = folded + moved;
    return moved;
end $$;

comment on table mail.campaign_day_counter is
    'Per campaign and local day of sending: its sent emails and their outcomes, as of the last fold '
    '(mail.fold_campaign_day_counters). mail.campaign_outcomes_daily adds mail.campaign_day_counter_delta. See '
    'docs/send_log.md, "Counters".';
comment on column mail.campaign_day_counter.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.campaign_day_counter.day is
    'Local date of sent_at in the scheduled campaign''s timezone (when sent), UTC otherwise.';
comment on column mail.campaign_day_counter.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_day_counter.key is
    'sent (emails the provider accepted) or delivered, hard_bounced, soft_bounced, complained, failed_after_send, '
    'suppressed, unique_opens, unique_clicks, with_outcome (of those; with_outcome: a final outcome, not delayed).';
comment on column mail.campaign_day_counter.n is 'The count.';
comment on table mail.campaign_day_counter_delta is
    'Changes of mail.campaign_day_counter not folded yet, appended by statement-level triggers on mail.send_log '
    'and mail.delivery_status in the changing transaction; emptied by mail.fold_campaign_day_counters.';
comment on column mail.campaign_day_counter_delta.campaign is 'Campaign name.';
comment on column mail.campaign_day_counter_delta.day is 'Day of sending (see mail.campaign_day_counter.day).';
comment on column mail.campaign_day_counter_delta.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_day_counter_delta.key is 'Counter key (see mail.campaign_day_counter.key).';
comment on column mail.campaign_day_counter_delta.n is 'Change of the count (negative: emails left the key).';
comment on table mail.campaign_day_counter_state is
    'One row: whether the day counters were seeded (a full count once) and the last fold.';
comment on column mail.campaign_day_counter_state.singleton is 'Always true: the table holds exactly one row.';
comment on column mail.campaign_day_counter_state.seeded_at is
    'When the first fold counted the sent emails (null: not yet; mail.campaign_outcomes_daily counts the send log).';
comment on column mail.campaign_day_counter_state.folded_at is 'When the last fold ran (timestamptz, UTC).';
comment on column mail.campaign_day_counter_state.folded is 'Delta rows folded so far (the seed counts its counter rows).';
comment on function mail.fold_campaign_day_counters() is
    'Fold the pending changes into mail.campaign_day_counter (the first call seeds it with a full count); returns '
    'the rows folded, or null if another fold is running. Safe to call at any time, by anyone.';
comment on function mail.sent_day(timestamptz, text) is
    'The local date of an instant in an IANA zone: the day mail.campaign_outcomes_daily counts a sent email on.';
