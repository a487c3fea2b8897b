-- 0028: per-campaign counters, so the progress page and the summaries stay flat as the send log grows.
--
-- mail.campaign_progress and mail.campaign_outcomes (0021, 0025) count a campaign's rows every time they are
-- read: ~3 s per campaign at 3M send-log rows, growing with the campaign. The counters hold the same numbers,
-- kept incrementally:
--
-- * mail.campaign_counter (campaign, key, n): the folded counts. Keys are the columns of mailflow.model.tally
--   (pending, sending, sent, failed, cancelled, duplicate, skipped, holdout, invalid, dead_lettered,
--   rolled_back; mail.send_log_counter_keys maps a row to its keys) and the outcome columns of
--   mail.campaign_outcomes (delivered, hard_bounced, soft_bounced, complained, failed_after_send, suppressed,
--   unique_opens, unique_clicks, with_outcome; mail.delivery_status_counter_keys).
-- * mail.campaign_counter_delta (campaign, key, n): what changed since the last fold. A STATEMENT-level
--   trigger on mail.send_log and mail.delivery_status (AFTER INSERT / UPDATE / DELETE, with transition
--   tables) appends, per statement, one row per (campaign, key) whose count moved: keys of the new rows +1,
--   of the old rows -1, grouped, zeros left out. A chunk's mint appends one row, its apply two. Written in the
--   statement's own transaction: a change and its delta commit or roll back together (no watermark: an
--   uncommitted change has no visible delta, and nothing is ever counted from an event table whose ids can
--   commit out of order). No index: it is appended to and emptied by the fold.
-- * mail.fold_campaign_counters(): moves the visible deltas into the counters (DELETE ... RETURNING, summed,
--   upserted): each delta row is deleted by exactly one fold, so two folds at once count nothing twice. It
--   runs under the state row's lock, skipped (returns null) when another fold holds it. The reconcile DAG
--   calls it every run; anyone may call it (SECURITY DEFINER: analysts included).
-- * mail.campaign_counter_state: seeded_at is null until the first fold has counted the send log once (the
--   seed: one statement, one snapshot: the full count and the deletion of every delta that snapshot sees;
--   a change committed after it has its delta left for the next fold). Until then readers use the views.
--
-- Readers add the unfolded deltas to the counters (queries/counters.sql): exact at any time, however long
-- ago the last fold ran. This file only takes brief locks (new tables and functions; CREATE TRIGGER takes a
-- SHARE ROW EXCLUSIVE lock on mail.send_log and mail.delivery_status for the rest of this short
-- transaction). The seed's full count runs later, outside it (mailflow migrate does not wait for it).

create table if not exists mail.campaign_counter (
    campaign text   not null,
    key      text   not null,
    n        bigint not null,
    primary key (campaign, key)
);

create table if not exists mail.campaign_counter_delta (
    campaign text   not null,
    key      text   not null,
    n        bigint not null
);
-- Emptied by every fold: small and churned; vacuum it often.
alter table mail.campaign_counter_delta set (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

create table if not exists mail.campaign_counter_state (
    singleton  boolean     primary key default true check (singleton),
    seeded_at  timestamptz,
    folded_at  timestamptz,
    folded     bigint      not null default 0
);
insert into mail.campaign_counter_state default values on conflict do nothing;

-- The counter keys of one send-log row (mailflow.model.tally): its status, except that a failed row is
-- rolled_back when released, and is also counted in dead_lettered when given up and in invalid when
-- never claimed (an invalid address decided without a request) and not released.
create or replace function mail.send_log_counter_keys(status text, released boolean, dead_lettered boolean,
                                                      claimed boolean) returns text[]
    language sql immutable parallel safe
    return case when status <> 'failed' then array[status]
                else array[case when released then 'rolled_back' else 'failed' end]
                     || case when dead_lettered then array['dead_lettered'] else '{}'::text[] end
                     || case when not released and not claimed then array['invalid'] else '{}'::text[] end
           end;

-- The outcome keys of one delivery_status row (mail.campaign_outcomes_daily counts each column once per
-- email): every outcome column set, the unique open and click, and with_outcome (a final outcome: not
-- null, not delayed; no_outcome_yet = sent - with_outcome).
create or replace function mail.delivery_status_counter_keys(delivered_at timestamptz, hard_bounced_at timestamptz,
                                                             soft_bounced_at timestamptz, complained_at timestamptz,
                                                             failed_at timestamptz, suppressed_at timestamptz,
                                                             first_opened_at timestamptz,
                                                             first_clicked_at timestamptz, outcome text)
    returns text[]
    language sql immutable parallel safe
    return array_remove(array[
        case when delivered_at is not null then 'delivered' end,
        case when hard_bounced_at is not null then 'hard_bounced' end,
        case when soft_bounced_at is not null then 'soft_bounced' end,
        case when complained_at is not null then 'complained' end,
        case when failed_at is not null then 'failed_after_send' end,
        case when suppressed_at is not null then 'suppressed' end,
        case when first_opened_at is not null then 'unique_opens' end,
        case when first_clicked_at is not null then 'unique_clicks' end,
        case when outcome is not null and outcome <> 'delayed' then 'with_outcome' end], null);

create or replace function mail.count_send_log_insert() returns trigger language plpgsql as $$
begin
    insert into mail.campaign_counter_delta (campaign, key, n)
    select r.campaign, k.key, count(*)
    from new_rows r
    cross join unnest(mail.send_log_counter_keys(r.status, r.released_at is not null, r.dead_lettered_at is not null,
                                                 r.claimed_at is not null)) as k(key)
    group by r.campaign, k.key;
    return null;
end $$;

create or replace function mail.count_send_log_update() returns trigger language plpgsql as $$
begin
    insert into mail.campaign_counter_delta (campaign, key, n)
    select x.campaign, x.key, sum(x.n)
    from (select r.campaign, k.key, 1 as n
          from new_rows r
          cross join unnest(mail.send_log_counter_keys(r.status, r.released_at is not null,
                                                       r.dead_lettered_at is not null, r.claimed_at is not null)) as k(key)
          union all
          select r.campaign, k.key, -1
          from old_rows r
          cross join unnest(mail.send_log_counter_keys(r.status, r.released_at is not null,
                                                       r.dead_lettered_at is not null, r.claimed_at is not null)) as k(key)
         ) as x
    group by x.campaign, x.key
    having sum(x.n) <> 0;
    return null;
end $$;

create or replace function mail.count_send_log_delete() returns trigger language plpgsql as $$
begin
    insert into mail.campaign_counter_delta (campaign, key, n)
    select r.campaign, k.key, -count(*)
    from old_rows r
    cross join unnest(mail.send_log_counter_keys(r.status, r.released_at is not null, r.dead_lettered_at is not null,
                                                 r.claimed_at is not null)) as k(key)
    group by r.campaign, k.key;
    return null;
end $$;

-- delivery_status rows name their email, not its campaign: one primary-key probe of mail.send_log each.
create or replace function mail.count_delivery_status_change() returns trigger language plpgsql as $$
begin
    if tg_op = 'INSERT' then
        insert into mail.campaign_counter_delta (campaign, key, n)
        select l.campaign, k.key, count(*)
        from new_rows r
        join mail.send_log l on l.id = r.send_log_id
        cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at, r.soft_bounced_at,
                          r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at, r.first_clicked_at,
                          r.outcome)) as k(key)
        group by l.campaign, k.key;
    elsif tg_op = 'UPDATE' then
        insert into mail.campaign_counter_delta (campaign, key, n)
        select l.campaign, x.key, sum(x.n)
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
        join mail.send_log l on l.id = x.send_log_id
        group by l.campaign, x.key
        having sum(x.n) <> 0;
    else
        insert into mail.campaign_counter_delta (campaign, key, n)
        select l.campaign, k.key, -count(*)
        from old_rows r
        join mail.send_log l on l.id = r.send_log_id
        cross join unnest(mail.delivery_status_counter_keys(r.delivered_at, r.hard_bounced_at, r.soft_bounced_at,
                          r.complained_at, r.failed_at, r.suppressed_at, r.first_opened_at, r.first_clicked_at,
                          r.outcome)) as k(key)
        group by l.campaign, k.key;
    end if;
    return null;
end $$;

drop trigger if exists send_log_count_insert on mail.send_log;
create trigger send_log_count_insert after insert on mail.send_log
    referencing new table as new_rows for each statement execute function mail.count_send_log_insert();
drop trigger if exists send_log_count_update on mail.send_log;
create trigger send_log_count_update after update on mail.send_log
    referencing old table as old_rows new table as new_rows for each statement
    execute function mail.count_send_log_update();
drop trigger if exists send_log_count_delete on mail.send_log;
create trigger send_log_count_delete after delete on mail.send_log
    referencing old table as old_rows for each statement execute function mail.count_send_log_delete();
drop trigger if exists delivery_status_count_insert on mail.delivery_status;
create trigger delivery_status_count_insert after insert on mail.delivery_status
    referencing new table as new_rows for each statement execute function mail.count_delivery_status_change();
drop trigger if exists delivery_status_count_update on mail.delivery_status;
create trigger delivery_status_count_update after update on mail.delivery_status
    referencing old table as old_rows new table as new_rows for each statement
    execute function mail.count_delivery_status_change();
drop trigger if exists delivery_status_count_delete on mail.delivery_status;
create trigger delivery_status_count_delete after delete on mail.delivery_status
    referencing old table as old_rows for each statement execute function mail.count_delivery_status_change();

-- TRUNCATE fires no row or statement change trigger: emptying the send log (a test, `demo --reset`) empties
-- the counters with it (delivery_status goes too: it references the send log).
create or replace function mail.count_send_log_truncate() returns trigger language plpgsql as $$
begin
    delete from mail.campaign_counter;
    delete from mail.campaign_counter_delta;
    return null;
end $$;
drop trigger if exists send_log_count_truncate on mail.send_log;
create trigger send_log_count_truncate after truncate on mail.send_log
    for each statement execute function mail.count_send_log_truncate();

-- A send log without a row (a new installation, a test database) is seeded as it stands: nothing to count,
-- and no writer can add a row before this transaction commits (CREATE TRIGGER's lock above).
update mail.campaign_counter_state set seeded_at = now(), folded_at = now()
where seeded_at is null and not exists (select 1 from mail.send_log) and not exists (select 1 from mail.delivery_status);

-- Fold the visible deltas into the counters; the first call seeds them (a full count of the send log and of
-- delivery_status: about a minute at 20M rows). Returns the delta rows folded (the seed: the counter rows
-- written), or null when another fold holds the state row (nothing to wait for: it folds the same deltas).
-- Each statement below takes its own snapshot after the state row's lock is held, so it sees everything the
-- previous fold committed.
create or replace function mail.fold_campaign_counters() returns bigint
    language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    seeded timestamptz;
    moved  bigint;
begin
    select s.seeded_at into seeded from mail.campaign_counter_state s for update skip locked;
    if not found then
        return null;
    end if;
    if seeded is null then
        -- One statement, one snapshot: the counts as of that snapshot, and the deltas it sees deleted
        -- (their changes are in the counts); deltas committed after it stay for the next fold. A
        -- data-modifying WITH runs to completion whether or not the rest reads it.
        with gone as (
            delete from mail.campaign_counter_delta returning 1
        ), base as (
            select l.campaign, k.key, count(*) as n
            from mail.send_log l
            cross join unnest(mail.send_log_counter_keys(l.status, l.released_at is not null,
                                                         l.dead_lettered_at is not null, l.claimed_at is not null)) as k(key)
            group by l.campaign, k.key
            union all
            select l.campaign, k.key, count(*)
            from mail.delivery_status d
            join mail.send_log l on l.id = d.send_log_id
            cross join unnest(mail.delivery_status_counter_keys(d.delivered_at, d.hard_bounced_at, d.soft_bounced_at,
                              d.complained_at, d.failed_at, d.suppressed_at, d.first_opened_at, d.first_clicked_at,
                              d.outcome)) as k(key)
            group by l.campaign, k.key
        ), counted as (
            insert into mail.campaign_counter (campaign, key, n)
            select b.campaign, b.key, b.n from base b
            on conflict (campaign, key) do update set n = excluded.n
            returning 1
        )
        select count(*) into moved from counted;
        update mail.campaign_counter_state set seeded_at = now(), folded_at = now(), folded = folded + moved;
        return moved;
    end if;
    with gone as (
        delete from mail.campaign_counter_delta returning campaign, key, n
    ), summed as (
        select g.campaign, g.key, sum(g.n) as n, count(*) as rows_ from gone g group by g.campaign, g.key
    ), upserted as (
        insert into mail.campaign_counter as c (campaign, key, n)
        select s.campaign, s.key, s.n from summed s
        on conflict (campaign, key) do update set n = c.n + excluded.n
    )
    select coalesce(sum(s.rows_), 0) into moved from summed s;
    update mail.campaign_counter_state set folded_at = now(), folded = folded + moved;
    return moved;
end $$;

comment on table mail.campaign_counter is
    'Per campaign: its send-log rows by mailflow.model.tally column and its sent emails by outcome, as of the '
    'last fold (mail.fold_campaign_counters). Add mail.campaign_counter_delta for the counts now '
    '(mail.campaign_counts does). See docs/send_log.md, "Counters".';
comment on column mail.campaign_counter.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.campaign_counter.key is
    'pending, sending, sent, failed, cancelled, duplicate, skipped, holdout, invalid, dead_lettered, rolled_back '
    '(rows, as mail.campaign_progress counts them) or delivered, hard_bounced, soft_bounced, complained, '
    'failed_after_send, suppressed, unique_opens, unique_clicks, with_outcome (sent emails, as '
    'mail.campaign_outcomes counts them; with_outcome: a final outcome, not delayed).';
comment on column mail.campaign_counter.n is 'The count.';
comment on table mail.campaign_counter_delta is
    'Changes of mail.campaign_counter not folded yet, appended by statement-level triggers on mail.send_log and '
    'mail.delivery_status in the changing transaction; emptied by mail.fold_campaign_counters.';
comment on column mail.campaign_counter_delta.campaign is 'Campaign name.';
comment on column mail.campaign_counter_delta.key is 'Counter key (see mail.campaign_counter.key).';
comment on column mail.campaign_counter_delta.n is 'Change of the count (negative: rows left the key).';
comment on table mail.campaign_counter_state is
    'One row: whether the counters were seeded (a full count once) and the last fold.';
comment on column mail.campaign_counter_state.singleton is 'Always true: the table holds exactly one row.';
comment on column mail.campaign_counter_state.seeded_at is 'When the first fold counted the send log (null: not yet; readers use the views).';
comment on column mail.campaign_counter_state.folded_at is 'When the last fold ran (timestamptz, UTC).';
comment on column mail.campaign_counter_state.folded is 'Delta rows folded so far (the seed counts its counter rows).';
comment on function mail.fold_campaign_counters() is
    'Fold the pending changes into mail.campaign_counter (the first call seeds it with a full count); returns the '
    'rows folded, or null if another fold is running. Safe to call at any time, by anyone.';

-- The counts now: folded counters plus the unfolded deltas, one row per (campaign, key).
create or replace view mail.campaign_counts as
select x.campaign, x.key, sum(x.n)::bigint as n
from (select c.campaign, c.key, c.n from mail.campaign_counter c
      union all
      select d.campaign, d.key, d.n from mail.campaign_counter_delta d) as x
group by x.campaign, x.key;
comment on view mail.campaign_counts is
    'Per campaign and counter key, the count now: mail.campaign_counter plus the unfolded deltas. Valid once '
    'mail.campaign_counter_state.seeded_at is set.';
comment on column mail.campaign_counts.campaign is 'Campaign name.';
comment on column mail.campaign_counts.key is 'Counter key (see mail.campaign_counter.key).';
comment on column mail.campaign_counts.n is 'The count now.';
