-- 0029: what a person approved for a scheduled campaign, as a fingerprint that provisioning checks.
--
-- mail.campaign_approval: one row per approval request (provision_campaign's plan asks one; the
-- `mailflow campaign provision --approve-as` CLI records one answered at once). `fingerprint` is
-- sha256 hex of everything that decides what is sent (mailflow.sources.scheduled.approval.fingerprint:
-- the campaign's whole definition, the bytes of the template files it renders and of its recipients
-- SQL file, and the recipient snapshot: the ordered user ids and their count). The parts are kept
-- beside it (definition, files, recipient_ids) so a refusal names what changed. Provisioning refuses
-- a campaign whose fingerprint now differs from the approved one; a draft's definition update voids
-- its open requests (state 'voided').
--
-- States: pending (asked, unanswered) -> approved | rejected | expired | voided (the draft was
-- replaced before the request was used). decided_by / decided_at / reason: who answered (the
-- Airflow user who responded, or the CLI's --approve-as), when, and the stated reason; for a void,
-- who replaced the definition and why. how: 'airflow_hitl' (a Required Action of provision_campaign),
-- 'cli' (mailflow campaign provision --approve-as), 'history' (backfilled below from the campaign
-- events written before this table existed: no fingerprint, so it never approves a new provisioning).
--
-- recipient_ids: the snapshot's user ids in ascending order (8 bytes a recipient, TOASTed); the
-- provisioning that follows an approval creates rows only for these ids.
-- New table and one index on it: no lock on the send log.
create table if not exists mail.campaign_approval (
    id                bigint      generated always as identity primary key,
    campaign_id       bigint      not null references mail.campaign (id),
    state             text        not null
                      check (state in ('pending', 'approved', 'rejected', 'expired', 'voided')),
    how               text        not null check (how in ('airflow_hitl', 'cli', 'history')),
    fingerprint       text        check (fingerprint ~ '^[0-9a-f]{64}$'),
    definition        jsonb,
    files             jsonb,
    recipient_count   bigint      check (recipient_count >= 0),
    recipients_sha256 text,
    recipient_ids     bigint[],
    requested_at      timestamptz not null default now(),
    requested_by      text,
    expires_at        timestamptz,
    decided_at        timestamptz,
    decided_by        text,
    reason            text,
    constraint campaign_approval_fingerprinted check (how = 'history' or fingerprint is not null),
    constraint campaign_approval_decided check ((state = 'pending') = (decided_at is null))
);
create index if not exists campaign_approval_campaign_idx on mail.campaign_approval (campaign_id, id);

comment on table mail.campaign_approval is
    'Approval requests of scheduled campaigns and their answers: which fingerprint (sha256 hex of the definition, '
    'template bytes and recipient snapshot) who approved, rejected or let expire, when and how; provisioning '
    'refuses a campaign whose fingerprint differs from the approved one.';
comment on column mail.campaign_approval.id is 'The request''s number (approval #id in messages and events).';
comment on column mail.campaign_approval.campaign_id is 'The scheduled campaign (mail.campaign.id).';
comment on column mail.campaign_approval.state is
    'pending (asked, unanswered), approved, rejected, expired (unanswered in time) or voided (the draft''s '
    'definition was replaced before the request was used).';
comment on column mail.campaign_approval.how is
    'airflow_hitl: a Required Action of provision_campaign; cli: mailflow campaign provision --approve-as; '
    'history: copied by 0029 from the campaign events recorded before approvals had fingerprints.';
comment on column mail.campaign_approval.fingerprint is
    'sha256 hex of the canonical definition, the file hashes and the recipient snapshot '
    '(mailflow.sources.scheduled.approval.fingerprint); null only for rows backfilled from history.';
comment on column mail.campaign_approval.definition is
    'The canonical definition the fingerprint covers (every definition field, as stored when requested).';
comment on column mail.campaign_approval.files is
    'Path relative to the campaigns folder -> sha256 hex of its bytes: the template files, their layouts, the '
    'recipients SQL file.';
comment on column mail.campaign_approval.recipient_count is 'Recipients in the snapshot (rows of the recipient source).';
comment on column mail.campaign_approval.recipients_sha256 is
    'sha256 hex of the recipients'' user ids in ascending order, each as decimal text and a newline.';
comment on column mail.campaign_approval.recipient_ids is
    'The approved recipients'' user ids, ascending; provisioning creates rows for these ids only.';
comment on column mail.campaign_approval.requested_at is 'When the request was recorded (the plan, or the CLI).';
comment on column mail.campaign_approval.requested_by is
    'Who asked: the plan task''s user and path, or the CLI''s --actor.';
comment on column mail.campaign_approval.expires_at is
    'When an unanswered Required Action takes its default answer (Reject); null for the CLI.';
comment on column mail.campaign_approval.decided_at is 'When it was answered or voided; null while pending.';
comment on column mail.campaign_approval.decided_by is
    'Who answered: the Airflow user who responded to the Required Action, the CLI operator (--approve-as), '
    'or, for a voided request, who replaced the definition.';
comment on column mail.campaign_approval.reason is
    'The operator''s reason (--reason), how it was answered, or why it was voided.';

-- Backfill from the campaign events recorded before this table: each rejection and expiry, and each
-- provisioning started by provision_campaign after its approval, becomes an answered request without a
-- fingerprint (how = 'history'). A provisioning started elsewhere (the CLI, a script) had no approval
-- and gets none. Idempotent: an event already copied (same campaign and time) is not copied again.
insert into mail.campaign_approval (campaign_id, state, how, requested_at, requested_by, decided_at, decided_by,
                                    reason)
select e.campaign_id,
       case e.detail ->> 'reason' when 'approval_rejected' then 'rejected'
                                  when 'approval_expired' then 'expired'
                                  else 'approved' end,
       'history', e.at, e.actor, e.at, e.actor,
       case when e.detail ->> 'reason' = 'provisioning started'
            then 'recorded before approvals had fingerprints: the provisioning that followed an approval'
            else 'recorded before approvals had fingerprints' end
from mail.campaign_event e
where (e.detail ->> 'reason' in ('approval_rejected', 'approval_expired')
       or (e.detail ->> 'reason' = 'provisioning started' and e.actor like 'provision_campaign/%'))
  and not exists (select 1 from mail.campaign_approval a
                  where a.campaign_id = e.campaign_id and a.how = 'history' and a.decided_at = e.at)
order by e.id;

-- the read-only role (0004) reads approvals like the other campaign tables
do $$
begin
    if exists (select 1 from pg_roles where rolname = 'mail_analyst') then
        execute 'grant select on mail.campaign_approval to mail_analyst';
    end if;
exception
    when insufficient_privilege then
        raise warning 'mailflow 0029: cannot grant to mail_analyst: %', sqlerrm;
end
$$;
