-- 0004: the send log for analysts: the views (stable names, documented columns), a comment on every table
-- and column of schema mail, and the read-only role mail_analyst.
-- Every timestamp is timestamptz (an instant; shown in the session's TimeZone, stored in UTC).

-- == indexes ==================================================================================
-- The narrow indexes the views read are built by 0009_analytics_indexes.sql, CONCURRENTLY and
-- outside a transaction, so upgrading a large send log never blocks readers or writers (this file
-- used to build them here, in one transaction that held an ACCESS EXCLUSIVE lock on mail.send_log
-- for the whole build). Until 0009 has run the views are correct, only slower.

-- == views ====================================================================================

-- Per campaign per local day. Each email contributes an event to the day it happened: minted
-- (created), sent, failed (rejected: the time of its attempt, claimed_at; given up: dead_lettered_at),
-- rolled back (released_at), cancelled (its 'cancelled' event) and dead-lettered. Days are local to
-- the campaign's timezone for scheduled campaigns (mail.campaign.timezone) and UTC otherwise. Each
-- branch reads one of the indexes above; a filter on campaign reaches all of them.
create view mail.campaign_daily as
select a.campaign,
       a.kind,
       coalesce(c.timezone, 'UTC')                                         as timezone,
       (a.at at time zone coalesce(c.timezone, 'UTC'))::date               as day,
       count(*) filter (where a.what = 'minted')                           as minted,
       count(*) filter (where a.what = 'sent')                             as sent,
       count(*) filter (where a.what = 'failed')                           as failed,
       count(*) filter (where a.what = 'rolled_back')                      as rolled_back,
       count(*) filter (where a.what = 'cancelled')                        as cancelled,
       count(*) filter (where a.what = 'dead_lettered')                    as dead_lettered,
       count(distinct a.user_id)                                           as unique_users
from (
    select l.campaign, l.kind, l.user_id, 'minted' as what, l.minted_at as at
    from mail.send_log l
    union all
    select l.campaign, l.kind, l.user_id, 'sent', l.sent_at
    from mail.send_log l
    where l.status = 'sent'
    union all
    select l.campaign, l.kind, l.user_id, x.what, x.at
    from mail.send_log l
    cross join lateral (values
        ('failed', case when l.released_at is null then coalesce(l.dead_lettered_at, l.claimed_at, l.minted_at) end),
        ('rolled_back', l.released_at),
        ('dead_lettered', l.dead_lettered_at)
    ) as x (what, at)
    where l.status = 'failed' and x.at is not null
    union all
    select l.campaign, l.kind, l.user_id, 'cancelled',
           coalesce((select min(e.at) from mail.send_event e
                     where e.send_log_id = l.id and e.to_status = 'cancelled'), l.minted_at)
    from mail.send_log l
    where l.status = 'cancelled'
) as a
left join mail.campaign c on a.kind = 'scheduled' and c.name = a.campaign
group by a.campaign, a.kind, coalesce(c.timezone, 'UTC'), (a.at at time zone coalesce(c.timezone, 'UTC'))::date;

-- Campaign progress now: counts by state, percent done, the current send rate and an estimated
-- completion. The rate is the emails sent in the last 5 minutes per minute of that window, or of the
-- time since the window's first send if that is shorter (at least 30 s), so a run that started a
-- minute ago is not averaged over five. One row per campaign name of the send log (found by a
-- skip scan of the campaign index) and per scheduled campaign without rows yet; each count is an
-- index-only scan of one state's index.
create view mail.campaign_progress as
with recursive seen (campaign) as (
    (select l.campaign from mail.send_log l order by l.campaign limit 1)
    union all
    select (select l.campaign from mail.send_log l where l.campaign > s.campaign order by l.campaign limit 1)
    from seen s
    where s.campaign is not null
)
select k.campaign,
       coalesce(f.kind, 'scheduled')                                          as kind,
       c.status                                                               as campaign_status,
       coalesce(c.timezone, 'UTC')                                            as timezone,
       o.pending + o.sending + st.sent + fl.failed + cn.cancelled             as total,
       o.pending, o.sending, st.sent, fl.failed, cn.cancelled, fl.rolled_back, fl.dead_lettered,
       st.sent + fl.failed + cn.cancelled                                     as done,
       coalesce(round(100.0 * (st.sent + fl.failed + cn.cancelled)
                      / nullif(o.pending + o.sending + st.sent + fl.failed + cn.cancelled, 0), 1), 0.0)
                                                                              as percent_done,
       st.sent_last_5m,
       round(r.per_min, 1)                                                    as send_rate_per_min,
       f.first_minted_at,
       st.last_sent_at,
       o.next_due_at,
       o.last_due_at,
       case when o.pending + o.sending = 0 then null
            when r.per_min > 0
                then greatest(now() + ((o.pending + o.sending) / r.per_min)::float8 * interval '1 minute',
                              o.last_due_at)
            else o.last_due_at
       end                                                                    as eta,
       (o.sending > 0 or (o.pending > 0 and c.status = 'scheduled'))          as active
from (select s.campaign from seen s where s.campaign is not null
      union
      select c.name from mail.campaign c) as k
left join lateral (select l.kind, l.minted_at as first_minted_at from mail.send_log l
                   where l.campaign = k.campaign order by l.minted_at limit 1) as f on true
cross join lateral (
    select count(*) filter (where l.status = 'pending')                         as pending,
           count(*) filter (where l.status = 'sending')                         as sending,
           min(l.scheduled_at) filter (where l.status = 'pending')              as next_due_at,
           max(l.scheduled_at) filter (where l.status = 'pending')              as last_due_at
    from mail.send_log l where l.campaign = k.campaign and l.status in ('pending', 'sending')) as o
cross join lateral (
    select count(*)                                                             as sent,
           count(*) filter (where l.sent_at >= now() - interval '5 minutes')    as sent_last_5m,
           min(l.sent_at) filter (where l.sent_at >= now() - interval '5 minutes') as window_first_sent,
           max(l.sent_at)                                                       as last_sent_at
    from mail.send_log l where l.campaign = k.campaign and l.status = 'sent') as st
cross join lateral (
    select count(*) filter (where l.released_at is null)                        as failed,
           count(*) filter (where l.released_at is not null)                    as rolled_back,
           count(*) filter (where l.dead_lettered_at is not null)               as dead_lettered
    from mail.send_log l where l.campaign = k.campaign and l.status = 'failed') as fl
cross join lateral (
    select count(*) as cancelled
    from mail.send_log l where l.campaign = k.campaign and l.status = 'cancelled') as cn
cross join lateral (
    select st.sent_last_5m * 60.0 / greatest(extract(epoch from now() - st.window_first_sent), 30) as per_min
) as r
left join mail.campaign c on c.name = k.campaign;

-- A user's full email history: one row per state change (mail.send_event) with its email.
create view mail.user_email_history as
select l.user_id,
       l.id                    as send_log_id,
       l.campaign,
       l.kind,
       l.email,
       l.status                as current_status,
       l.scheduled_at,
       l.minted_at,
       l.sent_at,
       l.released_at,
       l.dead_lettered_at,
       l.provider_message_id,
       e.id                    as event_id,
       e.at                    as event_at,
       e.from_status,
       e.to_status,
       e.attempt,
       e.error                 as event_error,
       e.dag_id,
       e.run_id,
       e.task_id
from mail.send_log l
left join mail.send_event e on e.send_log_id = l.id;

-- One row per email with its state: the send log without its internals (template context, batch
-- key and index). The progress page reads recent emails and errors here.
create view mail.email_status as
select l.id                            as send_log_id,
       l.campaign,
       l.kind,
       l.user_id,
       l.email,
       l.status,
       (l.released_at is not null)     as rolled_back,
       (l.dead_lettered_at is not null) as dead_lettered,
       l.attempts,
       l.error,
       l.scheduled_at,
       l.minted_at,
       l.claimed_at,
       l.sent_at,
       l.released_at,
       l.dead_lettered_at,
       l.provider_message_id,
       l.dag_id,
       l.run_id,
       l.task_id,
       l.data_interval_start,
       l.data_interval_end
from mail.send_log l;

-- == comments: tables =========================================================================
comment on schema mail is
    'The send log of mailflow: one row per email (send_log) with its state history (send_event), '
    'prepared batches, the shared provider rate schedule, suppressions and scheduled campaigns. '
    'Timestamps are timestamptz (UTC instants). See docs/send_log.md.';
comment on table mail.schema_migrations is
    'Applied migrations of schema mail (sql/migrations/NNNN_*.sql), one row each; written by mailflow.migrate.';
comment on column mail.schema_migrations.version is 'Migration number NNNN (the file name prefix); primary key.';
comment on column mail.schema_migrations.name is 'Migration file name, e.g. 0004_analytics.sql.';
comment on column mail.schema_migrations.applied_at is 'When the migration was applied (timestamptz, UTC).';

comment on table mail.send_log is
    'One row per email, minted before it is requested and changed only by guarded updates. '
    'Lifecycle rows are minted by the lifecycle_emails DAG (engine) as sending; scheduled rows are '
    'provisioned as pending by provision_campaign and claimed by dispatch_scheduled_emails; '
    'reconcile_send_log repairs stale claims. Every change appends a mail.send_event row.';
comment on column mail.send_log.id is 'Row id (identity); the X-Mailflow-Send-Id header of the email.';
comment on column mail.send_log.user_id is 'The recipient''s app.users.user_id (no foreign key: app may live elsewhere).';
comment on column mail.send_log.campaign is
    'Campaign name: a lifecycle campaign of campaigns/lifecycle.toml or a scheduled campaign (mail.campaign.name).';
comment on column mail.send_log.kind is 'lifecycle (hourly audience run) or scheduled (planned campaign).';
comment on column mail.send_log.email is
    'Recipient address as snapshotted when the row was minted (as typed by the user; not validated).';
comment on column mail.send_log.context is
    'Template variables snapshotted at minting (JSON object: the audience / recipient columns; '
    'scheduled rows also carry the rendered subject).';
comment on column mail.send_log.status is
    'pending (scheduled, waiting for its time), sending (claimed: requested or about to be), '
    'sent (the provider accepted this exact email), failed (rejected, given up, or rolled back when '
    'released_at is set), cancelled (never sent: campaign cancelled or user suppressed).';
comment on column mail.send_log.scheduled_at is
    'Scheduled rows: the planned send time (timestamptz, UTC), moved on resume or backoff; null for lifecycle rows.';
comment on column mail.send_log.minted_at is 'When the row was created (timestamptz, UTC; transaction time).';
comment on column mail.send_log.claimed_at is
    'When the row was last claimed for sending (timestamptz, UTC); a sending row older than the stale '
    'threshold (15 min) belongs to the reconciler.';
comment on column mail.send_log.sent_at is 'When the provider accepted the email (timestamptz, UTC); set with status sent.';
comment on column mail.send_log.released_at is
    'Lifecycle rows whose whole request certainly failed: when the attempt was rolled back (status failed). '
    'A released row leaves the unique (user_id, campaign) key so a later run may mint a new attempt.';
comment on column mail.send_log.provider_message_id is 'The provider''s email id (Resend id); required when status is sent.';
comment on column mail.send_log.idempotency_key is
    'Idempotency-Key of the batch request carrying this email (mail.send_batch); null until batched.';
comment on column mail.send_log.batch_index is 'Position of this email in its batch request (0-99); responses are applied by index.';
comment on column mail.send_log.attempts is 'Claims of this row so far (1 per request attempt by the engine or the dispatcher; reconciler resends add 1).';
comment on column mail.send_log.error is
    'Last error: the provider''s rejection message, the whole-request failure, or the reconciler''s note; null when sent.';
comment on column mail.send_log.dead_lettered_at is
    'When the email was given up for a person to decide (timestamptz, UTC): unknown outcome past the '
    '24 h idempotency window, or max_attempts whole-request failures. Null: not a dead letter.';
comment on column mail.send_log.dag_id is 'Airflow dag_id that minted or last claimed the row (null outside Airflow).';
comment on column mail.send_log.run_id is 'Airflow run_id that minted or last claimed the row.';
comment on column mail.send_log.task_id is 'Airflow task_id that minted or last claimed the row.';
comment on column mail.send_log.data_interval_start is 'Lifecycle rows: start of the minting run''s data interval (timestamptz, UTC).';
comment on column mail.send_log.data_interval_end is 'Lifecycle rows: end of the minting run''s data interval (timestamptz, UTC, exclusive).';

comment on table mail.send_event is
    'Every state change of a send_log row, appended in the same statement as the change (engine, '
    'dispatcher, reconciler, campaign controls).';
comment on column mail.send_event.id is 'Event id (identity; increases with time within one row).';
comment on column mail.send_event.send_log_id is 'The email (mail.send_log.id).';
comment on column mail.send_event.from_status is 'Status before the change; null for the creation event.';
comment on column mail.send_event.to_status is
    'Status after the change (pending, sending, sent, failed, cancelled); equal to from_status for '
    'notes (unknown outcome, resend, dead-lettering).';
comment on column mail.send_event.at is 'When the change happened (timestamptz, UTC; transaction time).';
comment on column mail.send_event.attempt is 'The row''s attempts value at the change (0 for provisioning).';
comment on column mail.send_event.error is 'Error or note recorded with the change (provider message, reason).';
comment on column mail.send_event.provider_message_id is 'Provider email id, on changes to sent.';
comment on column mail.send_event.dag_id is 'Airflow dag_id of the writer (null outside Airflow).';
comment on column mail.send_event.run_id is 'Airflow run_id of the writer.';
comment on column mail.send_event.task_id is 'Airflow task_id of the writer.';

comment on table mail.send_batch is
    'The exact request bytes of each prepared batch, so any retry under its Idempotency-Key is '
    'byte-identical; written in the transaction that mints or claims its rows.';
comment on column mail.send_batch.idempotency_key is 'Idempotency-Key of the request (mf-... lifecycle, mfs-... scheduled); primary key.';
comment on column mail.send_batch.campaign is 'Campaign name of the batch''s emails (one campaign per batch).';
comment on column mail.send_batch.email_count is 'Emails in the request (1-100).';
comment on column mail.send_batch.body is
    'The JSON request body (POST /emails/batch), byte for byte. Contains recipients and signed '
    'unsubscribe links: not readable by mail_analyst.';
comment on column mail.send_batch.created_at is 'When the batch was stored (timestamptz, UTC); the 24 h idempotency window starts here.';

comment on table mail.rate_slot is
    'The provider request schedule shared by every sender (one row per provider account), claimed '
    'atomically before each request by the pacer.';
comment on column mail.rate_slot.account is 'Provider account key (the API base URL).';
comment on column mail.rate_slot.next_slot is 'Earliest start of the next request on this account (timestamptz, UTC; database clock).';

comment on table mail.suppression is
    'Users or addresses that must not be emailed (unsubscribes, bounces, complaints, manual); read by '
    'every audience and by the dispatcher.';
comment on column mail.suppression.id is 'Suppression id (identity).';
comment on column mail.suppression.user_id is 'Suppressed app user (null when suppressed by address).';
comment on column mail.suppression.email is 'Suppressed address, compared case-insensitively (null when suppressed by user).';
comment on column mail.suppression.scope is 'all (every campaign) or one campaign name.';
comment on column mail.suppression.source is 'Who wrote it, e.g. unsubscribe, bounce, complaint, manual.';
comment on column mail.suppression.reason is 'Free-text reason (optional).';
comment on column mail.suppression.created_at is 'When the suppression was recorded (timestamptz, UTC).';

comment on table mail.campaign is
    'Scheduled campaigns: a plan (timezone, emails per day, weekdays, local windows, start) and a '
    'recipient source; created by the operator CLI, provisioned by provision_campaign.';
comment on column mail.campaign.id is 'Campaign id (identity).';
comment on column mail.campaign.name is 'Unique name ([a-z0-9_]); equals mail.send_log.campaign of its rows.';
comment on column mail.campaign.timezone is 'IANA timezone of the plan''s local days and windows, e.g. Europe/Berlin.';
comment on column mail.campaign.emails_per_day is 'Emails planned per local sending day (>= 1).';
comment on column mail.campaign.weekdays is 'ISO weekdays that send (1 = Monday .. 7 = Sunday).';
comment on column mail.campaign.windows is 'Local sending windows, text ''HH:MM-HH:MM'' in the campaign timezone.';
comment on column mail.campaign.start_at is 'Nothing is planned before this instant (timestamptz, UTC).';
comment on column mail.campaign.status is 'draft, scheduled (dispatched), paused, cancelled or completed.';
comment on column mail.campaign.template is 'Template name: campaigns/templates/<template>.{html,txt}.j2.';
comment on column mail.campaign.subject is 'Jinja subject over user (the recipient row), rendered at provisioning.';
comment on column mail.campaign.from_address is 'From header, e.g. Team <team@mail.example.com>.';
comment on column mail.campaign.reply_to is 'Reply-To address (optional).';
comment on column mail.campaign.recipients_sql is 'Recipient query file campaigns/recipients/<name>.sql (exclusive with recipients_table).';
comment on column mail.campaign.recipients_table is 'Recipient table, e.g. mail.campaign_recipient (exclusive with recipients_sql).';
comment on column mail.campaign.marketing is 'Marketing email: adds List-Unsubscribe headers (RFC 8058).';
comment on column mail.campaign.provisioned_count is 'Send-log rows created so far by provisioning.';
comment on column mail.campaign.provision_cursor is 'Provisioning checkpoint: the last user_id provisioned (keyset).';
comment on column mail.campaign.provisioned_at is 'When the recipient list was exhausted (timestamptz, UTC); null while provisioning.';
comment on column mail.campaign.plan_start is 'Anchor instant of the plan (timestamptz, UTC); reset on resume.';
comment on column mail.campaign.plan_skip is 'Slots skipped on the plan''s first local day (already used that day).';
comment on column mail.campaign.planned_through is 'Last planned send time given to a row (timestamptz, UTC); null: none yet.';
comment on column mail.campaign.created_at is 'When the campaign was created (timestamptz, UTC).';
comment on column mail.campaign.updated_at is 'Last change of the campaign row (timestamptz, UTC).';

comment on table mail.campaign_event is
    'Status changes and provisioning / re-planning milestones of scheduled campaigns, appended in the '
    'same transaction as the change.';
comment on column mail.campaign_event.id is 'Event id (identity).';
comment on column mail.campaign_event.campaign_id is 'The campaign (mail.campaign.id).';
comment on column mail.campaign_event.from_status is 'Campaign status before (null on creation).';
comment on column mail.campaign_event.to_status is 'Campaign status after (equal to from_status for milestones).';
comment on column mail.campaign_event.at is 'When it happened (timestamptz, UTC).';
comment on column mail.campaign_event.detail is 'JSON details (reason, counts, re-planned range, spec).';
comment on column mail.campaign_event.actor is 'Who: an operator name or dag_id/run_id/task_id.';

comment on table mail.campaign_recipient is
    'Uploaded recipient lists of scheduled campaigns (CSV upload), one row per campaign and user.';
comment on column mail.campaign_recipient.campaign_id is 'The campaign (mail.campaign.id).';
comment on column mail.campaign_recipient.user_id is 'Recipient''s app user id.';
comment on column mail.campaign_recipient.email is 'Recipient address as uploaded.';
comment on column mail.campaign_recipient.first_name is 'First name for the greeting (optional).';
comment on column mail.campaign_recipient.context is 'Extra CSV columns as a JSON object (template variables).';

-- == comments: views ==========================================================================
comment on view mail.campaign_daily is
    'Per campaign per day: emails minted, sent, failed, rolled back, cancelled, dead-lettered and the '
    'distinct users concerned, each counted on the day it happened. Day = local date in the '
    'campaign''s timezone for scheduled campaigns, UTC date otherwise. Filter by campaign (index-backed).';
comment on column mail.campaign_daily.campaign is 'Campaign name (mail.send_log.campaign).';
comment on column mail.campaign_daily.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_daily.timezone is 'Timezone of day: the scheduled campaign''s IANA zone, or UTC.';
comment on column mail.campaign_daily.day is 'Local calendar date in timezone.';
comment on column mail.campaign_daily.minted is 'Rows created that day (lifecycle: minted by a run; scheduled: provisioned).';
comment on column mail.campaign_daily.sent is 'Emails accepted by the provider that day (by sent_at).';
comment on column mail.campaign_daily.failed is
    'Emails failed for good, on the day of their last attempt (claimed_at: a rejection comes back in '
    'that request) or, when given up later (reconciler, out of attempts), of dead_lettered_at. '
    'Rolled-back attempts are not included.';
comment on column mail.campaign_daily.rolled_back is 'Lifecycle attempts released that day after a whole-request failure (by released_at).';
comment on column mail.campaign_daily.cancelled is 'Rows cancelled that day (by their cancelled event; campaign cancelled, or suppressed before sending).';
comment on column mail.campaign_daily.dead_lettered is 'Rows dead-lettered that day (by dead_lettered_at).';
comment on column mail.campaign_daily.unique_users is 'Distinct users with any of the above that day.';

comment on view mail.campaign_progress is
    'Progress of each campaign now: counts by state, percent done, the current send rate and an '
    'estimated completion. Filter by campaign (index-backed); unfiltered it reads every row.';
comment on column mail.campaign_progress.campaign is 'Campaign name.';
comment on column mail.campaign_progress.kind is 'lifecycle or scheduled.';
comment on column mail.campaign_progress.campaign_status is 'mail.campaign.status for scheduled campaigns; null for lifecycle campaigns.';
comment on column mail.campaign_progress.timezone is 'The scheduled campaign''s IANA zone, or UTC.';
comment on column mail.campaign_progress.total is 'Emails of the campaign (rows, excluding rolled-back attempts).';
comment on column mail.campaign_progress.pending is 'Rows waiting for their planned time (scheduled).';
comment on column mail.campaign_progress.sending is 'Rows claimed and in flight (or awaiting the reconciler).';
comment on column mail.campaign_progress.sent is 'Rows accepted by the provider.';
comment on column mail.campaign_progress.failed is 'Rows failed and not rolled back (rejected, given up).';
comment on column mail.campaign_progress.cancelled is 'Rows cancelled before sending.';
comment on column mail.campaign_progress.rolled_back is 'Released attempts (whole-request failures; history, not in total).';
comment on column mail.campaign_progress.dead_lettered is 'Rows dead-lettered (need a person).';
comment on column mail.campaign_progress.done is 'sent + failed + cancelled (terminal emails).';
comment on column mail.campaign_progress.percent_done is 'done / total in percent (0-100, one decimal); 0 when total is 0.';
comment on column mail.campaign_progress.sent_last_5m is 'Emails sent in the last 5 minutes (database clock).';
comment on column mail.campaign_progress.send_rate_per_min is
    'Current send rate, emails per minute (one decimal): sent_last_5m per minute since the first of those '
    'sends (at least 30 s, at most the 5 minutes).';
comment on column mail.campaign_progress.first_minted_at is 'First row created (timestamptz, UTC).';
comment on column mail.campaign_progress.last_sent_at is 'Last email sent (timestamptz, UTC).';
comment on column mail.campaign_progress.next_due_at is 'Earliest planned time of a pending row (timestamptz, UTC).';
comment on column mail.campaign_progress.last_due_at is 'Latest planned time of a pending row: the plan''s end (timestamptz, UTC).';
comment on column mail.campaign_progress.eta is
    'Estimated completion (timestamptz, UTC): null when nothing is open; otherwise the later of '
    'now + open rows at the current rate and the plan''s last pending time (unknown = null for a '
    'lifecycle campaign that sends nothing right now).';
comment on column mail.campaign_progress.active is
    'Sends are in progress: rows sending, or pending rows of a scheduled (not paused) campaign.';

comment on view mail.user_email_history is
    'A user''s full email history: one row per state change (mail.send_event) joined to its email '
    '(mail.send_log); an email without events appears once with null event columns. Filter by user_id '
    '(index-backed) and order by event_at, event_id.';
comment on column mail.user_email_history.user_id is 'Recipient''s app user id.';
comment on column mail.user_email_history.send_log_id is 'The email (mail.send_log.id).';
comment on column mail.user_email_history.campaign is 'Campaign name.';
comment on column mail.user_email_history.kind is 'lifecycle or scheduled.';
comment on column mail.user_email_history.email is 'Recipient address snapshot.';
comment on column mail.user_email_history.current_status is 'The email''s status now (mail.send_log.status).';
comment on column mail.user_email_history.scheduled_at is 'Planned send time (scheduled rows; timestamptz, UTC).';
comment on column mail.user_email_history.minted_at is 'When the email row was created (timestamptz, UTC).';
comment on column mail.user_email_history.sent_at is 'When the provider accepted it (timestamptz, UTC).';
comment on column mail.user_email_history.released_at is 'When the attempt was rolled back (timestamptz, UTC).';
comment on column mail.user_email_history.dead_lettered_at is 'When it was dead-lettered (timestamptz, UTC).';
comment on column mail.user_email_history.provider_message_id is 'Provider email id of the accepted email.';
comment on column mail.user_email_history.event_id is 'The state change (mail.send_event.id).';
comment on column mail.user_email_history.event_at is 'When the change happened (timestamptz, UTC).';
comment on column mail.user_email_history.from_status is 'Status before the change (null: creation).';
comment on column mail.user_email_history.to_status is 'Status after the change.';
comment on column mail.user_email_history.attempt is 'Attempt number at the change.';
comment on column mail.user_email_history.event_error is 'Error or note recorded with the change.';
comment on column mail.user_email_history.dag_id is 'Airflow dag_id of the change''s writer.';
comment on column mail.user_email_history.run_id is 'Airflow run_id of the change''s writer.';
comment on column mail.user_email_history.task_id is 'Airflow task_id of the change''s writer.';

comment on view mail.email_status is
    'One row per email with its state (mail.send_log without template context and batch internals). '
    'Filter by campaign, user_id, run_id, status or time (index-backed).';
comment on column mail.email_status.send_log_id is 'The email (mail.send_log.id).';
comment on column mail.email_status.campaign is 'Campaign name.';
comment on column mail.email_status.kind is 'lifecycle or scheduled.';
comment on column mail.email_status.user_id is 'Recipient''s app user id.';
comment on column mail.email_status.email is 'Recipient address snapshot.';
comment on column mail.email_status.status is 'pending, sending, sent, failed or cancelled (see mail.send_log.status).';
comment on column mail.email_status.rolled_back is 'True for a released attempt (whole-request failure; status failed).';
comment on column mail.email_status.dead_lettered is 'True for a dead letter (given up; a person decides).';
comment on column mail.email_status.attempts is 'Request attempts so far.';
comment on column mail.email_status.error is 'Last error or note (provider message, whole-request failure, reconciler note).';
comment on column mail.email_status.scheduled_at is 'Planned send time (scheduled rows; timestamptz, UTC).';
comment on column mail.email_status.minted_at is 'When the row was created (timestamptz, UTC).';
comment on column mail.email_status.claimed_at is 'Last claim for sending (timestamptz, UTC).';
comment on column mail.email_status.sent_at is 'When the provider accepted it (timestamptz, UTC).';
comment on column mail.email_status.released_at is 'When the attempt was rolled back (timestamptz, UTC).';
comment on column mail.email_status.dead_lettered_at is 'When it was dead-lettered (timestamptz, UTC).';
comment on column mail.email_status.provider_message_id is 'Provider email id (sent rows).';
comment on column mail.email_status.dag_id is 'Airflow dag_id that minted or last claimed it.';
comment on column mail.email_status.run_id is 'Airflow run_id that minted or last claimed it.';
comment on column mail.email_status.task_id is 'Airflow task_id that minted or last claimed it.';
comment on column mail.email_status.data_interval_start is 'Lifecycle rows: start of the minting run''s data interval (timestamptz, UTC).';
comment on column mail.email_status.data_interval_end is 'Lifecycle rows: end of the minting run''s data interval (timestamptz, UTC, exclusive).';

-- == the read-only role =======================================================================
-- mail_analyst: USAGE on schema mail and SELECT on its tables and views (send_batch without its
-- body), nothing else: no write, no CREATE, nothing on app.*. Roles are cluster-wide: an existing
-- role (another database of the cluster, a concurrent migration) is fine. A migrator without
-- CREATEROLE skips the role with a warning instead of failing every DAG's migration step.
-- Give people access with: create role alice login; grant mail_analyst to alice;
do $$
begin
    if not exists (select 1 from pg_roles where rolname = 'mail_analyst') then
        begin
            create role mail_analyst nologin;
            comment on role mail_analyst is
                'Read-only access to the mailflow send log (schema mail): SELECT only. Created by 0004_analytics.sql.';
        exception
            when duplicate_object or unique_violation then null;  -- created concurrently
            when insufficient_privilege then
                raise warning 'mailflow 0004: cannot create role mail_analyst (needs CREATEROLE); '
                              'create it and re-grant as in 0004_analytics.sql';
                return;
        end;
    end if;
    execute 'grant usage on schema mail to mail_analyst';
    execute 'grant select on all tables in schema mail to mail_analyst';
    execute 'revoke select on mail.send_batch from mail_analyst';
    execute 'grant select (idempotency_key, campaign, email_count, created_at) on mail.send_batch to mail_analyst';
    -- tables and views that later migrations create (as the same migrating user) are readable too
    execute 'alter default privileges in schema mail grant select on tables to mail_analyst';
exception
    when insufficient_privilege then
        raise warning 'mailflow 0004: cannot grant to mail_analyst: %', sqlerrm;
end
$$;
