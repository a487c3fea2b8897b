-- name: save_batch
-- Keep the exact request bytes of a batch (any later retry resends these bytes, in the same
-- validation mode) and assign its idempotency key, which never collides (docs/model.md):
--   mf-<installation id>-<campaign tag>-<batch serial>-<16 hex of sha256(body)>
-- The installation id is unique per database (0006), the serial per batch in it, and the body
-- digest makes a key restored from a backup name the same bytes or a different key.
-- key_identity: the sending API key's identity (a resend must use the same key).
-- campaign_content_hash: the campaign content the bytes were rendered from (with the bytes, never apart).
insert into mail.send_batch (idempotency_key, campaign, email_count, body, validation, key_identity,
                             campaign_content_hash)
select 'mf-' || i.id || '-' || %(tag)s || '-' || nextval('mail.send_batch_serial')::text
           || '-' || left(encode(sha256(%(body)s::bytea), 'hex'), 16),
       %(campaign)s, %(count)s, %(body)s, %(validation)s, %(key_identity)s, %(content_hash)s
from mail.installation i
returning idempotency_key

-- name: assign_batch
-- Record each row's batch and request index (request index i = row_ids[i]). A row that was ever
-- part of an ambiguous request keeps its key forever: it is never given another batch.
update mail.send_log l
set idempotency_key = %(key)s, batch_index = b.idx
from unnest(%(ids)s::bigint[], %(idx)s::int[]) as b(id, idx)
where l.id = b.id and l.status = 'sending' and l.ambiguous_at is null
returning l.id

-- name: mark_sent
-- Accepted by the provider: sending -> sent with its provider id. Guarded on the current state,
-- so a retried apply or a concurrent reconciler changes nothing twice.
with changed as (
    update mail.send_log l
    set status = 'sent', provider_message_id = a.pid, sent_at = now(), error = null
    from unnest(%(ids)s::bigint[], %(pids)s::text[]) as a(id, pid)
    where l.id = a.id and l.status = 'sending'
    returning l.id, l.attempts, l.provider_message_id
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, provider_message_id, dag_id, run_id, task_id)
select id, 'sending', 'sent', attempts, provider_message_id, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: mark_failed
-- Rejected by the provider (this exact email): sending -> failed with the provider's message.
-- The row keeps the unique key: the same address is not retried by the next run.
with changed as (
    update mail.send_log l
    set status = 'failed', error = a.msg
    from unnest(%(ids)s::bigint[], %(msgs)s::text[]) as a(id, msg)
    where l.id = a.id and l.status = 'sending'
    returning l.id, l.attempts, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', 'failed', attempts, error, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: release
-- The whole request was proven not processed (the provider's answer says so): the rows go back
-- without charging the user anything (docs/model.md, "Attempts count only real attempts").
-- Lifecycle rows: sending -> failed with released_at set, which takes the row out of the unique
-- key so the next run's audience decides again whether the user still qualifies (the row stays
-- as history; it excludes nobody).
-- Scheduled rows: sending -> pending again, keeping their place in the plan, without their key
-- and with the claim's attempt given back (no request of theirs was processed).
-- A row that was ever part of an ambiguous request is never released (ambiguous_at guard): it
-- keeps its key and bytes until a 2xx answers that key, or it becomes a dead letter.
-- A scheduled row of a campaign that is no longer active (cancelled or completed while the batch
-- was in flight) becomes 'cancelled' with the reason instead: a pending row there would never be
-- picked up and would count as a planned contact. The campaign rows are locked FOR SHARE, so a
-- cancel in progress is waited for and its committed status is the one read here (a locking read
-- returns the latest version of the row); a cancel that comes later finds the row pending.
with camp as materialized (
    select k.name, k.status
    from mail.campaign k
    where k.name in (select d.campaign from mail.send_log d
                     where d.id = any(%(ids)s::bigint[]) and d.kind = 'scheduled')
    for share of k
), inactive as (
    select name, status from camp where status in ('cancelled', 'completed')
), changed as (
    update mail.send_log l
    set status = case when l.kind = 'scheduled' and l.campaign in (select name from inactive) then 'cancelled'
                      when l.kind = 'scheduled' then 'pending' else 'failed' end,
        released_at = case when l.kind = 'lifecycle' then now() end,
        attempts = case when l.kind = 'scheduled' then greatest(l.attempts - 1, 0) else l.attempts end,
        idempotency_key = case when l.kind = 'scheduled' then null else l.idempotency_key end,
        batch_index = case when l.kind = 'scheduled' then null else l.batch_index end,
        error = case when l.kind = 'scheduled' and l.campaign in (select name from inactive)
                     then %(reason)s || ' (campaign ' || (select i.status from inactive i where i.name = l.campaign)
                          || ': not returned to pending)'
                     else %(reason)s end
    where l.id = any(%(ids)s::bigint[]) and l.status = 'sending' and l.ambiguous_at is null
    returning l.id, l.attempts, l.status, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', status, attempts, error, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: release_withheld
-- `release` for the emails a 2xx answer refused, by index, for a field of the CAMPAIGN (its `from`,
-- headers, ...: Accepted.withheld): not the recipient's fault, so nobody is charged. Unlike a
-- whole-request failure this is an answer TO THEIR KEY that says, email by email, that these were
-- not sent (the same proof that fails a row by index), so it resolves a row that was part of an
-- ambiguous request too (the reconciler's same-key resend of a stale batch): its ambiguity ends
-- (ambiguous_at cleared; its events keep the history) and it is released like the others, never
-- failed for the campaign's mistake. Same campaign rules as `release`.
with camp as materialized (
    select k.name, k.status
    from mail.campaign k
    where k.name in (select d.campaign from mail.send_log d
                     where d.id = any(%(ids)s::bigint[]) and d.kind = 'scheduled')
    for share of k
), inactive as (
    select name, status from camp where status in ('cancelled', 'completed')
), changed as (
    update mail.send_log l
    set status = case when l.kind = 'scheduled' and l.campaign in (select name from inactive) then 'cancelled'
                      when l.kind = 'scheduled' then 'pending' else 'failed' end,
        released_at = case when l.kind = 'lifecycle' then now() end,
        ambiguous_at = null,
        attempts = case when l.kind = 'scheduled' then greatest(l.attempts - 1, 0) else l.attempts end,
        idempotency_key = case when l.kind = 'scheduled' then null else l.idempotency_key end,
        batch_index = case when l.kind = 'scheduled' then null else l.batch_index end,
        error = case when l.kind = 'scheduled' and l.campaign in (select name from inactive)
                     then %(reason)s || ' (campaign ' || (select i.status from inactive i where i.name = l.campaign)
                          || ': not returned to pending)'
                     else %(reason)s end
                || case when l.ambiguous_at is not null
                        then ' (its key was ambiguous since ' || l.ambiguous_at::text || '; this 2xx answered it)'
                        else '' end
    where l.id = any(%(ids)s::bigint[]) and l.status = 'sending'
    returning l.id, l.attempts, l.status, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', status, attempts, error, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: note_unknown
-- The outcome is unknown (or a later failure says nothing about an ambiguous row): the rows stay
-- 'sending' with their key and bytes, marked ambiguous from the first such answer on; the
-- sender's retries and then the reconciler resend the same bytes under the same key, and only a
-- 2xx resolves them. The reason is recorded on the row and as an event.
with changed as (
    update mail.send_log l
    set error = %(reason)s, ambiguous_at = case when %(ambiguous)s then coalesce(l.ambiguous_at, now())
                                                else l.ambiguous_at end
    where l.id = any(%(ids)s::bigint[]) and l.status = 'sending'
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'sending', 'sending', attempts, %(reason)s, %(dag_id)s, %(run_id)s, %(task_id)s from changed
returning send_log_id

-- name: refused_candidates
-- Rows of one campaign that failed for good (a per-recipient rejection, not released, not a dead
-- letter): the candidates `mailflow reopen-refused` classifies by the field their error names.
select id, kind, error, ambiguous_at is not null as ambiguous
from mail.send_log
where campaign = %(campaign)s and status = 'failed' and released_at is null and dead_lettered_at is null
  and error is not null
order by id

-- name: reopen_refused
-- Re-open rows the provider refused for a field of the CAMPAIGN (its `from`, headers, ...), which
-- charged users for the campaign's mistake: lifecycle rows are released (released_at: they leave
-- the unique key, the next run decides again), scheduled rows go back to 'pending' without their
-- key and with the attempt given back (as a release does). The old error stays in the row's
-- history (this event's error names it). A row that was part of an ambiguous request keeps what
-- it has (its key was answered; a CHECK forbids releasing it). Guarded on the state.
-- A scheduled row of a cancelled campaign becomes 'cancelled' (un-charged too), never 'pending'
-- there: nothing would pick it up (the campaign row is locked, so a cancel in progress is seen).
with camp as materialized (
    select k.name, k.status
    from mail.campaign k
    where k.name in (select d.campaign from mail.send_log d
                     where d.id = any(%(ids)s::bigint[]) and d.kind = 'scheduled')
    for share of k
), changed as (
    update mail.send_log l
    set status = case when l.kind = 'scheduled'
                           and l.campaign in (select name from camp where status = 'cancelled') then 'cancelled'
                      when l.kind = 'scheduled' then 'pending' else 'failed' end,
        released_at = case when l.kind = 'lifecycle' then now() end,
        attempts = case when l.kind = 'scheduled' then greatest(l.attempts - 1, 0) else l.attempts end,
        idempotency_key = case when l.kind = 'scheduled' then null else l.idempotency_key end,
        batch_index = case when l.kind = 'scheduled' then null else l.batch_index end,
        error = %(reason)s || ' (was: ' || coalesce(l.error, '') || ')'
    where l.id = any(%(ids)s::bigint[]) and l.status = 'failed' and l.released_at is null
      and l.dead_lettered_at is null and l.ambiguous_at is null
    returning l.id, l.attempts, l.status, l.error
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, task_id)
select id, 'failed', status, attempts, error, 'reopen-refused' from changed
returning send_log_id

-- name: reopen_campaign
-- A completed scheduled campaign whose rows were re-opened becomes 'paused' (with an event): the
-- person fixes the field and resumes it. Other states are left as they are.
with c as (
    update mail.campaign set status = 'paused', updated_at = now()
    where name = %(campaign)s and status = 'completed'
    returning id
)
insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)
select id, 'completed', 'paused', %(detail)s, 'reopen-refused' from c
returning campaign_id
