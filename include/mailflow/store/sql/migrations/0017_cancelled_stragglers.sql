-- 0017: no pending row is left in a campaign that will never send it (docs/model.md, "What counts
-- as a contact"). Until now a batch in flight when its campaign was cancelled, answered with a
-- proven-not-processed refusal (a quota 429, say), put its rows back to 'pending' inside the
-- cancelled campaign: nothing ever picked them up, and the contact policy counted them as planned
-- contacts "now", so those users got no lifecycle mail. From now on the release cancels such rows
-- (send_log.release); this migration cancels the ones already there, with the same reason on the
-- row and an event each (pending -> cancelled), so nothing recorded is lost: the rows stay as
-- history. A completed campaign can hold none (completion needs no pending row); it is included
-- for completeness. One short transaction; on a live send log it touches only those rows.
with gone as (
    update mail.send_log l
    set status = 'cancelled',
        error = 'campaign ' || c.status || ': a row returned to pending after the campaign ended '
                || '(cleaned up by migration 0017)'
    from mail.campaign c
    where c.name = l.campaign and c.status in ('cancelled', 'completed')
      and l.kind = 'scheduled' and l.status = 'pending'
    returning l.id, l.attempts, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, task_id)
select id, 'pending', 'cancelled', attempts, error, 'migration 0017' from gone;
