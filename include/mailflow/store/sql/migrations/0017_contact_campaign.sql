-- migrate: no-transaction
-- 0017: no pending row counts as a contact, or is left behind, in a campaign that will not send it
-- (docs/model.md, "What counts as a contact").
--
-- 1. Stragglers. Until now a batch in flight when its campaign was cancelled, answered with a
--    proven-not-processed refusal (a quota 429, say), put its rows back to 'pending' inside the
--    cancelled campaign: nothing ever picked them up, and the contact policy counted them as
--    planned contacts "now", so those users got no lifecycle mail. The release now cancels such
--    rows (send_log.release); this statement cancels the ones already there, with the reason on the
--    row and an event each (pending -> cancelled): the rows stay as history, nothing is lost. A
--    completed campaign can hold none (completion needs no pending row); it is included anyway.
--    One statement (atomic on its own), idempotent.
-- 2. The contact index gains the campaign (INCLUDE), so the policy's probes can count a planned
--    email only while its campaign is 'scheduled' (not paused, cancelled or completed) and stay
--    index-only (docs/performance.md): built CONCURRENTLY under a new name (no lock that blocks
--    reads or writes of mail.send_log; an interrupted build is dropped and rebuilt by
--    mailflow.migrate), then 0010's index is dropped (same rows, same key: the write path keeps
--    the same number of indexes) and the new one takes its name (a brief lock that does not
--    block reads or writes). Run again from the start, it ends the same.
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
create index concurrently if not exists send_log_contact_campaign_idx on mail.send_log (user_id, sent_at)
    include (status, scheduled_at, minted_at, campaign) where status in ('pending', 'sending', 'sent');
drop index concurrently if exists mail.send_log_contact_idx;
alter index if exists mail.send_log_contact_campaign_idx rename to send_log_contact_idx;
