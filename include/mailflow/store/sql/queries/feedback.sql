-- name: due_checks
-- Sent emails of the lookback window whose delivery status should be asked for now: never checked
-- (and sent at least min_age ago), or not final, checked fewer than max_checks times, and last
-- checked more than recheck * 2^(checks - 1) ago (exponential spacing). Never-checked first, then
-- the longest-waiting. The window is read through mail.sent_email (0011): one range of
-- send_log_campaign_sent_idx per campaign (the send log has no sent_at index of its own).
-- (Its rows always have a provider id: constraint send_log_sent_has_provider_id.)
select l.send_log_id as id, l.email, l.provider_message_id, coalesce(ds.checks, 0) as checks
from mail.sent_email l
left join mail.delivery_status ds on ds.send_log_id = l.send_log_id
where l.provider_message_id is not null
  and l.sent_at >= now() - make_interval(secs => %(lookback_seconds)s)
  and l.sent_at <= now() - make_interval(secs => %(min_age_seconds)s)
  and (ds.send_log_id is null
       or (not ds.final
           and ds.checks < %(max_checks)s
           and ds.checked_at <= now() - make_interval(secs => %(recheck_seconds)s * power(2, ds.checks - 1))))
order by ds.checked_at nulls first, l.sent_at, l.send_log_id
limit %(limit)s

-- name: record_check
-- What the provider said about one email, upserted on its send-log id (one row per email); checks
-- counts the polls, final stops them.
insert into mail.delivery_status as ds (send_log_id, provider_message_id, last_event, final)
values (%(id)s, %(pid)s, %(event)s, %(final)s)
on conflict (send_log_id) do update
    set last_event = excluded.last_event, final = excluded.final, provider_message_id = excluded.provider_message_id,
        checks = ds.checks + 1, checked_at = now()

-- name: record_decision
-- One feedback decision (suppressed, already suppressed, recipient mismatch, failed) as an event of
-- the email: sent -> sent (the row stays sent: the provider accepted its request), the decision in
-- error, the provider id asked about, and the Airflow run that decided. Only for a row still sent.
insert into mail.send_event (send_log_id, from_status, to_status, error, provider_message_id, dag_id, run_id, task_id)
select l.id, 'sent', 'sent', %(decision)s, %(pid)s, %(dag_id)s, %(run_id)s, %(task_id)s
from mail.send_log l
where l.id = %(id)s and l.status = 'sent'

-- name: user_of_row
-- The user of one send-log row (a bounced address that has no mailbox key is suppressed by user).
select user_id from mail.send_log where id = %(id)s
