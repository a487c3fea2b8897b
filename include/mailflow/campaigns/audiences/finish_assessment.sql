-- finish_assessment (priority 1): started an assessment in the window and did not finish it.
--
-- Rule: the user has an assessment with window_start <= started_at < window_end whose
-- finished_at is null (abandoned or still open) or not before window_end (finished only
-- after the window, so it was unfinished as of window_end).  A user with several such
-- assessments appears once, with the most recently started one.
--
-- Parameters: window_start, window_end (timestamptz, half-open window [start, end)).
-- The engine adds cooldown / suppression / dedupe exclusions and keyset pagination.
--
-- Columns:
--   user_id          bigint  unique per row
--   email            text
--   first_name       text    may be null or empty
--   assessment_id    bigint  the unfinished assessment (template: resume link)
--   assessment_kind  text    its kind, e.g. numerical, situational_judgement (template: copy)
--
-- Requires: an index on app.assessments (started_at) INCLUDE (user_id, assessment_id, kind,
-- finished_at) (the demo schema's assessments_started_at_cover_idx): the window is then one
-- index-only range instead of a heap visit per assessment (docs/performance.md, "Audience snapshot").
select distinct on (a.user_id)
       u.user_id,
       u.email,
       u.first_name,
       a.assessment_id,
       a.kind as assessment_kind
from app.assessments a
join app.users u on u.user_id = a.user_id
where a.started_at >= %(window_start)s
  and a.started_at < %(window_end)s
  and (a.finished_at is null or a.finished_at >= %(window_end)s)
order by a.user_id, a.started_at desc, a.assessment_id desc
