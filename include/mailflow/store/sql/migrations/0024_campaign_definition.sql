-- 0024: what a scheduled campaign's definition (mailflow.sources.scheduled.definition) needs stored.
--   * holidays: a country or country-subdivision code of the holidays library (DE, DE-BY, US-CA); the
--     planner sends nothing on those public holidays (local dates in the campaign's zone). Null: none.
--   * the name 'all' is reserved: it means "every campaign" in the CLI, the DAG forms and reports.
--   * windows are stored in the definition's one spelling: a window that ends on the next local date
--     at a time other than midnight says so with '+1' ('23:00-01:00+1'). Earlier rows wrote such a
--     window without it and the planner read it as overnight; the rewrite below keeps that meaning and
--     only changes the text, so provisioning's re-check of stored windows accepts them.
-- ADD COLUMN without a default is a catalog change; the check constraint scans mail.campaign (small).
alter table mail.campaign add column if not exists holidays text;
alter table mail.campaign drop constraint if exists campaign_holidays_code;
alter table mail.campaign add constraint campaign_holidays_code
    check (holidays is null or holidays ~ '^[A-Z]{2,3}(-.+)?$');

do $$
begin
    if exists (select 1 from mail.campaign where name = 'all') then
        raise exception 'mailflow 0024: a scheduled campaign is named ''all'', a reserved name; rename it '
                        '(update mail.campaign set name = ... where name = ''all'', and its send-log rows) '
                        'and migrate again';
    end if;
end
$$;
alter table mail.campaign drop constraint if exists campaign_name_not_reserved;
alter table mail.campaign add constraint campaign_name_not_reserved check (name <> 'all');

update mail.campaign c
set windows = (
    select array_agg(case when w ~ '^\d{1,2}:\d{2}(:\d{2})?-\d{1,2}:\d{2}(:\d{2})?$'
                          and split_part(w, '-', 2) not in ('24:00', '24:00:00')
                          and split_part(w, '-', 2)::time <> time '00:00'
                          and split_part(w, '-', 2)::time <= split_part(w, '-', 1)::time
                     then w || '+1' else w end
                     order by n)
    from unnest(c.windows) with ordinality as u(w, n))
where exists (select 1 from unnest(c.windows) as u(w)
              where w ~ '^\d{1,2}:\d{2}(:\d{2})?-\d{1,2}:\d{2}(:\d{2})?$'
                and split_part(w, '-', 2) not in ('24:00', '24:00:00')
                and split_part(w, '-', 2)::time <> time '00:00'
                and split_part(w, '-', 2)::time <= split_part(w, '-', 1)::time);

comment on column mail.campaign.holidays is
    'Public holidays skipped (no sends on those local dates): a holidays-library code, a country (DE) or a '
    'country-subdivision (DE-BY, US-CA); null: none skipped.';
comment on column mail.campaign.windows is
    'Local sending windows, text ''HH:MM-HH:MM'' in the campaign timezone; ''+1'' marks a window that ends on '
    'the next local date (''23:00-01:00+1''), ''24:00'' one that ends at midnight.';
