-- name: approval_insert
-- One approval request of a campaign with its fingerprint and parts: pending (a Required Action
-- waits), or approved at once (the CLI's --approve-as: decided_at/by/reason given). Returns its id.
insert into mail.campaign_approval (campaign_id, state, how, fingerprint, definition, files, recipient_count,
                                    recipients_sha256, recipient_ids, requested_by, expires_at, decided_at,
                                    decided_by, reason)
values (%(campaign_id)s, %(state)s, %(how)s, %(fingerprint)s, %(definition)s, %(files)s, %(recipient_count)s,
        %(recipients_sha256)s, %(recipient_ids)s, %(requested_by)s, %(expires_at)s,
        case when %(state)s = 'pending' then null else now() end, %(decided_by)s, %(reason)s)
returning id

-- name: approval_by_id
-- One approval request with its parts (no lock: its state changes only under the campaign's row
-- lock, which the callers that must not race a change hold).
select * from mail.campaign_approval where id = %(id)s

-- name: approval_decide
-- Answer a pending request (approved / rejected / expired). Guarded on 'pending': an answer to a
-- request voided meanwhile changes nothing (no row comes back) and the void stands.
update mail.campaign_approval
set state = %(state)s, decided_at = now(), decided_by = %(decided_by)s, reason = %(reason)s
where id = %(id)s and state = 'pending'
returning id

-- name: approval_void_open
-- Void a draft's open requests (pending, or approved and not yet used) when its definition is replaced;
-- the caller holds the campaign's row lock. Returns the requests voided with their previous state.
with open as (
    select id, state from mail.campaign_approval
    where campaign_id = %(campaign_id)s and state in ('pending', 'approved') and fingerprint is not null
    for update
)
update mail.campaign_approval a
set state = 'voided', decided_at = now(), decided_by = %(decided_by)s, reason = %(reason)s
from open
where a.id = open.id
returning a.id, open.state, a.fingerprint

-- name: approval_latest_decided
-- The campaign's latest answered request (approved, rejected, expired or voided; pending ones wait
-- for their answer and decide nothing yet), by the time of its answer: what the CLI provisions with.
select * from mail.campaign_approval
where campaign_id = %(campaign_id)s and state <> 'pending'
order by decided_at desc, id desc
limit 1

-- name: recipient_ids
-- Every recipient's user_id of a campaign's recipient source, ascending (the recipient snapshot of
-- an approval). The source is the campaign's version-controlled SQL file or a checked table name,
-- composed as SQL, never from input.
select r.user_id
from (
{source}
) as r
order by r.user_id
