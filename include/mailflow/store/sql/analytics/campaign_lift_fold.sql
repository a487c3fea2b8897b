-- campaign_lift_fold: mail.fold_campaign_lift(horizon, settle), the rollup of the lift's closed windows
-- (docs/send_log.md, Q15; the query: campaign_lift.sql).
--
-- For each campaign with a holdout group, the users whose conversion window started between the campaign's
-- watermark (mail.campaign_lift_fold.through, -infinity at first) and the new one are counted per group and
-- UTC day of the window's start into mail.campaign_lift_day, with how many converted, and the watermark moves
-- on, in the caller's transaction (rollup rows and watermark commit together: the lift query, one statement,
-- sees both or neither). The new watermark is now - horizon - settle: every window before it has closed, and
-- a conversion recorded up to `settle` late is still in it; for a scheduled campaign with rows left to send,
-- or cancelled, at most its latest send: a held-out user counts once the campaign's sending passed their
-- slot, as in the query. The window starts and the
-- conversion are those of campaign_lift.sql; tests hold the folded and the unfolded lift equal.
--
-- What it relies on: rows before a watermark do not change any more. A treated row's sent_at is written once
-- when the provider accepts it (now, never days in the past); a held-out row's start is its minting or a slot
-- of a plan made at or after provisioning; assessments are recorded when they finish (settle covers a late
-- one). A product that backfills old conversions, or a send log edited by hand, is folded again from scratch:
-- delete from mail.campaign_lift_fold (a campaign without a watermark has its rollup rows replaced by the
-- next fold, and the query ignores them meanwhile), then fold.
--
-- One fold at a time per horizon (a transaction-level advisory lock; a second call returns null at once). The
-- first fold reads every campaign's history once (as the unfolded query does); later ones read the rows of
-- the time since the previous fold. Returns the rollup rows written, or null if another fold is running.
--
-- Like the query, it reads the product's schema (app.assessments): installed where both schemas are visible
-- (the demo loader installs it with the view mail.campaign_lift; elsewhere psql -f this file as the send log's
-- owner), and then called by the reconcile DAG on every run (mailflow.store.lift.fold). SECURITY DEFINER:
-- mail_analyst may call it (it writes only the rollup).
create or replace function mail.fold_campaign_lift(horizon interval default interval '7 days',
                                                   settle interval default interval '1 day') returns bigint
    language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
#variable_conflict use_column
declare
    k     record;
    cut   timestamptz;
    lo    timestamptz;
    hi    timestamptz;
    n     bigint;
    moved bigint := 0;
begin
    if fold_campaign_lift.horizon <= interval '0' or fold_campaign_lift.settle < interval '0' then
        raise exception 'mail.fold_campaign_lift: horizon must be positive and settle not negative (got %, %)',
            fold_campaign_lift.horizon, fold_campaign_lift.settle;
    end if;
    if not pg_try_advisory_xact_lock(740621503, hashtext(fold_campaign_lift.horizon::text)) then
        return null;
    end if;
    for k in
        with recursive seen (campaign) as (
            (select h.campaign from mail.send_log h where h.status = 'holdout' order by h.campaign limit 1)
            union all
            select (select h.campaign from mail.send_log h where h.status = 'holdout' and h.campaign > s.campaign
                    order by h.campaign limit 1)
            from seen s
            where s.campaign is not null
        )
        select s.campaign,
               (select h.kind from mail.send_log h where h.campaign = s.campaign and h.status = 'holdout' limit 1)
                   as kind,
               coalesce((select f.through from mail.campaign_lift_fold f
                         where f.campaign = s.campaign and f.horizon = fold_campaign_lift.horizon),
                        '-infinity'::timestamptz) as through
        from seen s
        where s.campaign is not null
    loop
        lo := k.through;
        hi := now() - fold_campaign_lift.horizon - fold_campaign_lift.settle;
        if k.kind = 'scheduled'
           and ((select o.scheduled_at from mail.send_log o
                 where o.campaign = k.campaign and o.status in ('pending', 'sending')
                 order by o.campaign, o.scheduled_at limit 1) is not null
                or exists (select 1 from mail.campaign m where m.name = k.campaign and m.status = 'cancelled')) then
            -- the query's cut: a held-out user counts once the campaign's sending passed their slot
            select max(t.sent_at) into cut from mail.send_log t where t.campaign = k.campaign and t.status = 'sent';
            continue when cut is null;  -- nothing sent yet: nobody counts
            hi := least(hi, cut);
        end if;
        continue when hi <= lo;
        if lo = '-infinity'::timestamptz then
            -- no watermark: folded from the start (a first fold, or a refold after its row was deleted)
            delete from mail.campaign_lift_day d where d.campaign = k.campaign and d.horizon = fold_campaign_lift.horizon;
        end if;
        with l as (
            select 'treated' as grp, t.user_id, t.sent_at as start_at from mail.send_log t
            where t.campaign = k.campaign and t.status = 'sent' and t.sent_at >= lo and t.sent_at < hi
            union all
            select 'holdout', h.user_id, coalesce(h.scheduled_at, h.minted_at) from mail.send_log h
            where h.campaign = k.campaign and h.status = 'holdout'
              and coalesce(h.scheduled_at, h.minted_at) >= lo and coalesce(h.scheduled_at, h.minted_at) < hi
        ), g as (
            select l.grp, (l.start_at at time zone 'UTC')::date as day,
                   exists (select 1 from app.assessments a
                           where a.user_id = l.user_id
                             and a.started_at < l.start_at + fold_campaign_lift.horizon
                             and a.finished_at >= l.start_at
                             and a.finished_at < l.start_at + fold_campaign_lift.horizon) as converted
            from l
        ), written as (
            insert into mail.campaign_lift_day as d (campaign, horizon, grp, day, users, converted)
            select k.campaign, fold_campaign_lift.horizon, g.grp, g.day, count(*), count(*) filter (where g.converted)
            from g
            group by g.grp, g.day
            on conflict (campaign, horizon, grp, day) do update
                set users = d.users + excluded.users, converted = d.converted + excluded.converted
            returning 1
        )
        select count(*) into n from written;
        insert into mail.campaign_lift_fold as f (campaign, horizon, kind, through, folded_at)
        values (k.campaign, fold_campaign_lift.horizon, k.kind, hi, now())
        on conflict (campaign, horizon) do update set through = excluded.through, folded_at = excluded.folded_at;
        moved := moved + n;
    end loop;
    return moved;
end $$;

comment on function mail.fold_campaign_lift(interval, interval) is
    'Fold the lift''s closed conversion windows (per campaign, group and day) into mail.campaign_lift_day and move '
    'each campaign''s watermark (mail.campaign_lift_fold); returns the rollup rows written, or null if another '
    'fold of that horizon is running. Installed from store/sql/analytics/campaign_lift_fold.sql (it reads the '
    'product''s conversions); docs/send_log.md, Q15.'
